"""The images carry the package version (pyproject.toml's), and everything that names them names
that version: the Containerfiles take it as a build argument, label the image with it
(``org.opencontainers.image.version``) and refuse to build with another; the build commands the
docs give tag ``:$VERSION``; the kustomize base and the Helm chart run the images by it. A version
bump in pyproject.toml that misses one of them fails here.
"""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.realk8s.image import instructions

ROOT = Path(__file__).resolve().parents[1]
CONTAINERFILES = sorted((ROOT / "deploy" / "containers").glob("Containerfile.*"))
IMAGES = {"Containerfile.control-plane": "gpufleet-control-plane", "Containerfile.node-agent": "gpufleet-node-agent"}
PRODUCTION = ROOT / "docs" / "production" / "index.md"


def package_version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def version_check(path: Path) -> str:
    (step,) = [arg for op, arg in instructions(path) if op == "RUN" and "pyproject.toml" in arg and "VERSION" in arg]
    return step


def build_commands(text: str) -> list[str]:
    return [line.strip().lstrip("#").strip() for line in text.splitlines() if "podman build" in line]


def test_containerfiles_take_the_version_and_label_the_image_with_it() -> None:
    assert {p.name for p in CONTAINERFILES} == set(IMAGES)
    for path in CONTAINERFILES:
        steps = instructions(path)
        assert ("ARG", "VERSION") in steps, f"{path.name}: the version is a build argument"
        (label,) = [arg for op, arg in steps if op == "LABEL"]
        assert 'org.opencontainers.image.version="${VERSION}"' in label.split(), path.name
        assert f"org.opencontainers.image.title={IMAGES[path.name]}" in label.split(), path.name
        # Given before the check uses it, and before the package is installed.
        ops = [op for op, _ in steps]
        check = steps.index(("RUN", version_check(path)))
        assert ops.index("ARG") < check < next(i for i, (op, arg) in enumerate(steps) if "pip install" in arg)


def test_the_documented_builds_tag_and_pass_the_version() -> None:
    sources = {path.name: path.read_text() for path in CONTAINERFILES}
    sources[PRODUCTION.name] = PRODUCTION.read_text()
    shown = {name: build_commands(text) for name, text in sources.items()}
    docs = shown.pop(PRODUCTION.name)
    for name, image in IMAGES.items():
        want = (f"podman build -f deploy/containers/{name} --build-arg VERSION=$VERSION "
                f"-t {image}:$VERSION .")
        assert shown[name] == [want], f"{name}'s header"
        assert want in docs, f"docs/production/index.md builds {image} as {name} says"
    assert not [line for line in docs if ":$VERSION" not in line], "every documented build tags the version"


@pytest.mark.integration  # runs the Containerfiles' own shell lines
def test_the_build_refuses_another_version_and_the_documented_version_is_pyprojects(tmp_path: Path) -> None:
    version = package_version()
    for path in CONTAINERFILES:
        check = version_check(path)
        for given, code in ((version, 0), (f"{version}.post1", 1), ("", 1)):
            done = subprocess.run(["sh", "-c", check], cwd=ROOT, env={"VERSION": given, "PATH": "/usr/bin:/bin"},
                                  capture_output=True, text=True)
            assert done.returncode == code, (path.name, given, done.stderr)
            assert code == 0 or "--build-arg VERSION=" in done.stderr
    # The line the docs and the Containerfiles give to read the version reads pyproject's.
    (assignment,) = {line.split("#")[0].strip() for line in PRODUCTION.read_text().splitlines()
                     if line.strip().startswith("VERSION=$(")}
    done = subprocess.run(["sh", "-c", f"{assignment}; printf %s \"$VERSION\""], cwd=ROOT, capture_output=True,
                          text=True)
    assert done.stdout == version, done.stderr


def test_the_base_and_the_chart_run_the_images_by_the_package_version() -> None:
    version = package_version()
    base = ROOT / "deploy" / "kubernetes"
    kustomization = yaml.safe_load((base / "kustomization.yaml").read_text())
    assert not kustomization.get("images"), "the base's own files name the tag, no kustomize override"
    images = []
    for resource in kustomization["resources"]:
        for doc in yaml.safe_load_all((base / resource).read_text()):
            pod = ((doc or {}).get("spec") or {}).get("template", {}).get("spec") or {}
            images += [c["image"] for c in pod.get("containers", []) + pod.get("initContainers", [])]
    ours = sorted({image for image in images if image.split(":")[0] in IMAGES.values()})
    assert ours == sorted({f"{image}:{version}" for image in IMAGES.values()})

    chart = ROOT / "deploy" / "helm" / "gpufleet"
    assert yaml.safe_load((chart / "Chart.yaml").read_text())["appVersion"] == version
    # An empty tag is the appVersion (tests/test_helm.py renders it so with the real helm).
    assert yaml.safe_load((chart / "values.yaml").read_text())["images"]["tag"] == ""


#: ``image: [registry/]gpufleet-<image>[:tag]`` wherever a manifest or a page's snippet names one.
IMAGE_LINE = re.compile(r"image:\s*[\"']?(?:[\w.\-]+/)*(gpufleet-(?:control-plane|node-agent))(:[\w.\-]+)?")


def test_every_manifest_and_snippet_names_the_images_by_the_package_version() -> None:
    """Not only the base: an overlay's patch and a page's YAML snippet an operator copies name the
    images by the package version too. The own-rack seed server's snippet in
    deploy/bootstrap/README.md named `gpufleet-control-plane` bare, a `:latest` never built or
    pushed (the pod would wait in ImagePullBackOff); it is deploy/own-racks now."""
    version = package_version()
    paths = [p for p in (ROOT / "deploy").rglob("*") if p.suffix in (".yaml", ".yml", ".md") and "helm" not in p.parts]
    paths += [*(ROOT / "docs").rglob("*.md"), ROOT / "README.md"]
    named, wrong = 0, []
    for path in sorted(paths):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for image, tag in IMAGE_LINE.findall(line):
                named += 1
                if tag != f":{version}":
                    wrong.append(f"{path.relative_to(ROOT)}:{number}: {image}{tag}")
    assert named >= 4, "the base's three workloads and the seed server"
    assert not wrong, "images not named by the package version:\n" + "\n".join(wrong)
