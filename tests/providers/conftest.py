"""Provider harness fixtures, one import per adapter."""

from tests.providers.harness_aws import aws_harness  # noqa: F401
from tests.providers.harness_lambda import lambda_harness  # noqa: F401
from tests.providers.harness_own_dc import own_dc_harness  # noqa: F401
from tests.providers.harness_hetzner import hetzner_harness  # noqa: F401
from tests.providers.harness_nebius import nebius_harness  # noqa: F401
