"""Amazon EC2 adapter (boto3).

Configuration
    ``account.credentials`` names a secret holding ``ACCESS_KEY_ID:SECRET_ACCESS_KEY``
    (optionally ``:SESSION_TOKEN`` appended) or the same as JSON (``providers.credentials.aws_keys``,
    shared with the object stores). If ``account.options["profile"]`` is
    set, that boto3 profile is used instead and no secret is read.
    ``account.options``: ``endpoint_url`` (tests, VPC endpoints), ``subnet_id``,
    ``security_group_ids`` (list), ``key_name``, ``iam_instance_profile`` (name or
    ARN), ``user_data``, ``spot_max_price``, ``spot_interruption_risk`` (offer
    estimate, default 0.1), ``max_attempts`` (botocore attempts per call, default 1),
    ``connect_timeout`` / ``read_timeout`` (seconds).
    The region is ``site.region``; the AMI is ``spec.image`` or ``site.image``.

Quirks
    * Idempotency: ``RunInstances`` gets ``ClientToken`` = the idempotency key when it
      is at most 64 printable ASCII characters, else its SHA-256 hex digest. EC2
      returns the original instance for a repeated token. The same token is also
      written to the ``gpufleet.io/idempotency-key`` tag and looked up before
      launching, so a repeat is answered without a second ``RunInstances`` (and
      emulators that ignore ``ClientToken`` behave too).
    * botocore's own retries are off by default (``max_attempts`` 1): the Temporal
      retry policy owns backoff, so a throttled call surfaces at once as ``Transient``.
    * Error codes map through ``ERROR_CODES`` (exact code) and then the HTTP status
      (``5xx`` -> ``Transient``, other ``4xx`` -> ``InvalidRequest``); a code with no
      status at all is ``Transient``. EC2 answers capacity shortages with HTTP 500,
      so the code table is consulted before the status.
    * ``InvalidInstanceID.NotFound``/``.Malformed`` are ``NotFound``: an id EC2 cannot
      parse cannot name a live machine. Deleting such an id succeeds.
    * Terminated instances stay visible to ``DescribeInstances`` for about an hour;
      ``get_machine`` reports them with state ``terminated``, ``list_machines``
      leaves them out.
    * ``reboot_machine`` is ``RebootInstances``: EC2 asks the OS to reboot and forces a
      hard reboot if it has not shut down within four minutes. EC2 has no immediate
      power cycle for a running instance.
    * ``reinstall_machine`` is ``CreateReplaceRootVolumeTask`` with the instance's own
      launch AMI and ``DeleteReplacedRootVolume``: the instance keeps its id, network
      interfaces and instance-store data; the root volume is rebuilt from the AMI and
      the instance reboots. The task runs asynchronously.
    * Every instance is launched with IMDSv2 required and a hop limit of 2
      (``MetadataOptions``): the node agent's pod reads the spot notice through it.
    * Offers: one per site, for ``site.instance_type``, available when
      ``DescribeInstanceTypeOfferings`` lists it in the region; GPU count and memory
      come from ``DescribeInstanceTypes``; the price is ``site.price_per_gpu_hour``
      (the EC2 API does not return prices).
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any

import boto3
import botocore.exceptions as bce
import botocore.loaders
import botocore.session
from botocore.config import Config

from fleet.config import Account, Site
from fleet.errors import (
    BadCredentials,
    InvalidRequest,
    NoCapacity,
    NotFound,
    OverQuota,
    ProviderError,
    Transient,
)
from fleet.models import MACHINE_TAG_SITE, CapacityType, Machine, MachineSpec, Offer
from providers.base import transport_failure
from providers.credentials import aws_keys, read_secret

PROVIDER = "aws"

SITE_TAG = MACHINE_TAG_SITE
KEY_TAG = "gpufleet.io/idempotency-key"
MANAGED_TAG = "gpufleet.io/managed-by"

#: EC2 error code -> taxonomy. Consulted before the HTTP status.
ERROR_CODES: dict[str, type[ProviderError]] = {
    # The site cannot sell this now: try the next candidate.
    "InsufficientInstanceCapacity": NoCapacity,
    "InsufficientHostCapacity": NoCapacity,
    "InsufficientReservedInstanceCapacity": NoCapacity,
    "InsufficientCapacity": NoCapacity,
    "UnfulfillableCapacity": NoCapacity,
    "Unsupported": NoCapacity,
    "SpotMaxPriceTooLow": NoCapacity,
    # Limits only a person can raise.
    "InstanceLimitExceeded": OverQuota,
    "VcpuLimitExceeded": OverQuota,
    "MaxSpotInstanceCountExceeded": OverQuota,
    # The account cannot call EC2.
    "AuthFailure": BadCredentials,
    "UnauthorizedOperation": BadCredentials,
    "InvalidClientTokenId": BadCredentials,
    "ExpiredToken": BadCredentials,
    "SignatureDoesNotMatch": BadCredentials,
    "Blocked": BadCredentials,
    "OptInRequired": BadCredentials,
    "PendingVerification": BadCredentials,
    # Throttling and EC2-side failures.
    "RequestLimitExceeded": Transient,
    "Throttling": Transient,
    "ThrottlingException": Transient,
    "InternalError": Transient,
    "InternalFailure": Transient,
    "ServiceUnavailable": Transient,
    "Unavailable": Transient,
    # The request is wrong.
    "IdempotentParameterMismatch": InvalidRequest,
    "InvalidParameterValue": InvalidRequest,
    "InvalidParameterCombination": InvalidRequest,
    "MissingParameter": InvalidRequest,
    # The instance does not exist.
    "InvalidInstanceID.NotFound": NotFound,
    "InvalidInstanceID.Malformed": NotFound,
}

#: botocore exceptions raised without an EC2 answer -> taxonomy (first match wins).
EXCEPTION_ERRORS: tuple[tuple[type[Exception], type[ProviderError]], ...] = (
    (bce.NoCredentialsError, BadCredentials),
    (bce.PartialCredentialsError, BadCredentials),
    (bce.ProfileNotFound, BadCredentials),
    (bce.CredentialRetrievalError, BadCredentials),
    (bce.ParamValidationError, InvalidRequest),
    (bce.ConnectionError, Transient),  # connect/read timeouts, refused, closed
    (bce.HTTPClientError, Transient),
)
#: botocore's failures of the HTTP layer: their messages quote what urllib3 said (a header it
#: refused, the session token's included; a proxy's URL with its password), so neither their
#: message nor they themselves (a cause travels into workflow history) go into our error.
TRANSPORT_ERRORS: tuple[type[Exception], ...] = (bce.ConnectionError, bce.HTTPClientError)

#: EC2 instance state -> Machine.state.
STATES = {
    "pending": "pending",
    "running": "running",
    "stopping": "stopped",
    "stopped": "stopped",
    "shutting-down": "terminated",
    "terminated": "terminated",
}
LIVE_STATES = ["pending", "running", "stopping", "stopped"]


#: Parsed service models are shared by every session (loading EC2's takes ~0.5 s).
_LOADER = botocore.loaders.create_loader()
#: EC2 clients by (credential fingerprint, region, endpoint, config); clients are thread-safe.
_CLIENTS: dict[tuple[Any, ...], Any] = {}
_CLIENTS_LOCK = threading.Lock()
_CLIENTS_MAX = 32


def _boto3_session(**kwargs: Any) -> boto3.Session:
    core = botocore.session.Session()
    core.register_component("data_loader", _LOADER)
    return boto3.Session(botocore_session=core, **kwargs)


def client_token(idempotency_key: str) -> str:
    """EC2's ClientToken: at most 64 ASCII characters, case-sensitive."""
    if 0 < len(idempotency_key) <= 64 and idempotency_key.isascii() and idempotency_key.isprintable():
        return idempotency_key
    return hashlib.sha256(idempotency_key.encode()).hexdigest()


def classify(code: str, status: int | None) -> type[ProviderError]:
    """The taxonomy class for an EC2 error code and HTTP status."""
    if code in ERROR_CODES:
        return ERROR_CODES[code]
    if status is not None and 400 <= status < 500:
        return InvalidRequest
    return Transient


def _translate(exc: Exception, operation: str) -> ProviderError:
    if isinstance(exc, bce.ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code") or "Unknown")
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        cls = classify(code, status)
        return cls(f"EC2 {operation}: {code}: {error.get('Message', '')}", provider=PROVIDER, code=code)
    for exc_type, cls in EXCEPTION_ERRORS:
        if isinstance(exc, exc_type):
            code = type(exc).__name__
            said = transport_failure(exc) if isinstance(exc, TRANSPORT_ERRORS) else f"{code}: {exc}"
            return cls(f"EC2 {operation}: {said}", provider=PROVIDER, code=code)
    code = type(exc).__name__
    return Transient(f"EC2 {operation}: unexpected {code}: {exc}", provider=PROVIDER, code=code)


def _tags(instance: dict[str, Any]) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in instance.get("Tags", [])}


class AwsProvider:
    """EC2 in one region for one AWS account."""

    name = PROVIDER

    def __init__(self, site: Site, account: Account) -> None:
        self.site = site
        self.account = account
        self.options = dict(account.options)

    # -- plumbing ---------------------------------------------------------------

    def _credentials(self) -> tuple[str, dict[str, Any]]:
        """(fingerprint, boto3.Session arguments); the secret is read on every call."""
        profile = self.options.get("profile")
        if profile:
            return f"profile:{profile}", {"profile_name": profile}
        secret = read_secret(self.account.credentials, provider=PROVIDER)
        keys = aws_keys(secret, self.account.credentials, provider=PROVIDER)
        return hashlib.sha256(secret.encode()).hexdigest(), keys

    def _client(self) -> Any:
        """An EC2 client for the current credentials, cached while they do not change."""
        fingerprint, credentials = self._credentials()
        attempts = int(self.options.get("max_attempts", 1))
        connect_timeout = float(self.options.get("connect_timeout", 10))
        read_timeout = float(self.options.get("read_timeout", 60))
        endpoint = self.options.get("endpoint_url")
        cache_key = (fingerprint, self.site.region, endpoint, attempts, connect_timeout, read_timeout)
        with _CLIENTS_LOCK:
            if cache_key in _CLIENTS:
                return _CLIENTS[cache_key]
            config = Config(
                retries={"total_max_attempts": attempts, "mode": "standard"},
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
            )
            try:
                session = _boto3_session(**credentials)
                client = session.client("ec2", region_name=self.site.region, endpoint_url=endpoint, config=config)
            except bce.BotoCoreError as exc:
                raise _translate(exc, "client") from exc
            if len(_CLIENTS) >= _CLIENTS_MAX:
                _CLIENTS.pop(next(iter(_CLIENTS)))
            _CLIENTS[cache_key] = client
            return client

    def _call(self, operation: str, **params: Any) -> dict[str, Any]:
        client = self._client()
        try:
            return getattr(client, operation)(**params)
        except (bce.ClientError, bce.BotoCoreError) as exc:
            if isinstance(exc, TRANSPORT_ERRORS):
                raise _translate(exc, operation) from None
            raise _translate(exc, operation) from exc

    def _describe(self, **params: Any) -> list[dict[str, Any]]:
        instances: list[dict[str, Any]] = []
        while True:
            page = self._call("describe_instances", **params)
            for reservation in page.get("Reservations", []):
                instances.extend(reservation.get("Instances", []))
            token = page.get("NextToken")
            if not token:
                return instances
            params["NextToken"] = token

    def _machine(self, instance: dict[str, Any]) -> Machine:
        tags = _tags(instance)
        spot = instance.get("InstanceLifecycle") == "spot"
        return Machine(
            id=instance["InstanceId"],
            name=tags.get("Name", ""),
            site=tags.get(SITE_TAG, self.site.name),
            provider=PROVIDER,
            instance_type=instance.get("InstanceType", ""),
            state=STATES.get(instance.get("State", {}).get("Name", ""), "pending"),
            capacity_type=CapacityType.SPOT if spot else CapacityType.ON_DEMAND,
            created_at=instance.get("LaunchTime"),
            # The ownership marker: every instance the fleet launches carries this tag.
            owned=tags.get(MANAGED_TAG) == "gpufleet",
            addresses=[ip for ip in (instance.get("PrivateIpAddress"), instance.get("PublicIpAddress")) if ip],
        )

    # -- Provider ---------------------------------------------------------------

    def create_machine(self, spec: MachineSpec, idempotency_key: str, user_data: str = "") -> Machine:
        image = spec.image or self.site.image
        if not image:
            raise InvalidRequest(
                f"site {self.site.name}: no AMI (set image on the site or the spec)",
                provider=PROVIDER,
                code="MissingImage",
            )
        token = client_token(idempotency_key)
        existing = self._describe(
            Filters=[
                {"Name": f"tag:{KEY_TAG}", "Values": [token]},
                {"Name": "instance-state-name", "Values": LIVE_STATES},
            ]
        )
        if existing:
            return self._machine(existing[0])
        reply = self._call("run_instances", **self._run_params(spec, image, token, user_data))
        return self._machine(reply["Instances"][0])

    def _run_params(self, spec: MachineSpec, image: str, token: str, user_data: str = "") -> dict[str, Any]:
        tags = {**spec.tags, "Name": spec.name, SITE_TAG: self.site.name, KEY_TAG: token, MANAGED_TAG: "gpufleet"}
        params: dict[str, Any] = {
            "ImageId": image,
            "InstanceType": spec.instance_type or self.site.instance_type,
            "MinCount": 1,
            "MaxCount": 1,
            "ClientToken": token,
            "TagSpecifications": [
                {"ResourceType": "instance", "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]},
            ],
        }
        # IMDSv2 only (tokens required), its token's answer reaching one hop past the instance:
        # the node agent reads the spot notice from a pod without host networking, where the
        # default limit of 1 never delivers a token. Enabled explicitly: an account's metadata
        # defaults may turn the endpoint off.
        params["MetadataOptions"] = {"HttpTokens": "required", "HttpPutResponseHopLimit": 2, "HttpEndpoint": "enabled"}
        if spec.capacity_type == CapacityType.SPOT:
            spot: dict[str, Any] = {"SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"}
            if self.options.get("spot_max_price"):
                spot["MaxPrice"] = str(self.options["spot_max_price"])
            params["InstanceMarketOptions"] = {"MarketType": "spot", "SpotOptions": spot}
        if self.options.get("subnet_id"):
            params["SubnetId"] = self.options["subnet_id"]
        if self.options.get("security_group_ids"):
            params["SecurityGroupIds"] = list(self.options["security_group_ids"])
        if self.options.get("key_name"):
            params["KeyName"] = self.options["key_name"]
        profile = self.options.get("iam_instance_profile")
        if profile:
            params["IamInstanceProfile"] = {"Arn": profile} if profile.startswith("arn:") else {"Name": profile}
        # The machine's own bootstrap (boto3 base64-encodes it); the account's fixed option only without one.
        if user_data or self.options.get("user_data"):
            params["UserData"] = user_data or self.options["user_data"]
        return params

    def delete_machine(self, machine_id: str) -> None:
        try:
            self._call("terminate_instances", InstanceIds=[machine_id])
        except NotFound:
            return

    def get_machine(self, machine_id: str) -> Machine:
        instances = self._describe(InstanceIds=[machine_id])
        if not instances:
            raise NotFound(f"EC2 instance {machine_id} not found", provider=PROVIDER, code="InvalidInstanceID.NotFound")
        return self._machine(instances[0])

    def list_machines(self) -> list[Machine]:
        instances = self._describe(
            Filters=[
                {"Name": f"tag:{SITE_TAG}", "Values": [self.site.name]},
                {"Name": "instance-state-name", "Values": LIVE_STATES},
            ]
        )
        return [self._machine(i) for i in instances]

    def reboot_machine(self, machine_id: str) -> None:
        self._call("reboot_instances", InstanceIds=[machine_id])

    def reinstall_machine(self, machine_id: str, user_data: str = "") -> None:
        if user_data:
            # UserData changes only on a stopped instance, and a root volume replacement needs it
            # running: no in-place reinstall can carry a fresh bootstrap.
            raise InvalidRequest(f"EC2 instance {machine_id}: a reinstall cannot carry new user data; replace it",
                                 provider=PROVIDER, code="reinstall-rebootstrap-unsupported")
        instance = self._describe(InstanceIds=[machine_id])
        if not instance:
            raise NotFound(f"EC2 instance {machine_id} not found", provider=PROVIDER, code="InvalidInstanceID.NotFound")
        self._call(
            "create_replace_root_volume_task",
            InstanceId=machine_id,
            ImageId=instance[0]["ImageId"],
            DeleteReplacedRootVolume=True,
        )

    def list_offers(self) -> list[Offer]:
        instance_type = self.site.instance_type
        offerings = self._call(
            "describe_instance_type_offerings",
            LocationType="region",
            Filters=[{"Name": "instance-type", "Values": [instance_type]}],
        ).get("InstanceTypeOfferings", [])
        types = self._call("describe_instance_types", InstanceTypes=[instance_type]).get("InstanceTypes", [])
        gpus = (types[0].get("GpuInfo", {}).get("Gpus") or [{}])[0] if types else {}
        spot = self.site.capacity_type == CapacityType.SPOT
        return [self.site.offer(
            PROVIDER,
            gpus=int(gpus.get("Count") or self.site.gpus_per_machine),
            gpu_memory_gb=int(gpus.get("MemoryInfo", {}).get("SizeInMiB", 0)) // 1024 or self.site.gpu_memory_gb,
            interruption_risk=float(self.options.get("spot_interruption_risk", 0.1)) if spot else 0.0,
            available=any(o.get("InstanceType") == instance_type for o in offerings),
        )]
