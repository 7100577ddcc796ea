"""A Temporal dev server of a test's own that suggests continue-as-new after a few events, so
an entity reaches its continue-as-new path within seconds (the default is thousands)."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import AsyncIterator

from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from cli.dev import dev_server_tuning_flags, temporal_binary
from fleet import search_attributes


@asynccontextmanager
async def server_suggesting_continue_as_new(after_events: int) -> AsyncIterator[WorkflowEnvironment]:
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_binary(), data_converter=pydantic_data_converter,
        search_attributes=search_attributes.ALL, dev_server_log_level="error",
        dev_server_extra_args=[*dev_server_tuning_flags(), "--dynamic-config-value",
                               f"limit.historyCount.suggestContinueAsNew={after_events}"],
    )
    try:
        yield env
    finally:
        await env.shutdown()
