"""The workers' workflow runner skips per-payload serialization contexts only
when nothing in the data converter could use them."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from temporalio.api.common.v1 import Payload
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.converter import PayloadCodec, SerializationContext, WithSerializationContext
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner

from workers.start_input import StartInputRunner
from workers.workflow_runner import ContextFreeRunner, ignores_context, workflow_runner


class PlainCodec(PayloadCodec):
    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return list(payloads)

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return list(payloads)


class PerWorkflowKeyCodec(PlainCodec, WithSerializationContext):
    """A codec that would encrypt with a key per workflow: it needs the context."""

    def __init__(self, context: SerializationContext | None = None) -> None:
        self.context = context

    def with_context(self, context: SerializationContext) -> "PerWorkflowKeyCodec":
        return PerWorkflowKeyCodec(context)


def test_gpufleet_converter_takes_the_shortcut() -> None:
    assert ignores_context(pydantic_data_converter)
    runner = workflow_runner(pydantic_data_converter)
    assert isinstance(runner, StartInputRunner) and isinstance(runner.inner, ContextFreeRunner)


def test_a_codec_keeps_the_sdk_runner() -> None:
    for codec in (PlainCodec(), PerWorkflowKeyCodec()):
        converter = dataclasses.replace(pydantic_data_converter, payload_codec=codec)
        assert not ignores_context(converter)
        runner = workflow_runner(converter)
        assert isinstance(runner, StartInputRunner) and isinstance(runner.inner, SandboxedWorkflowRunner)
