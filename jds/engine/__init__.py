"""Serving engine: paged KV block manager, continuous-batching scheduler, sampling and the step loop.

Pure host-side (numpy) code; the model is reached only through ``runner.execute`` (sync stepping) or
``runner.submit`` (async stepping), so the engine can be tested with the deterministic
``jds.engine.fake.FakeRunner``.
"""

from jds.engine.blocks import BlockManager
from jds.engine.core import Engine, EngineStats
from jds.engine.request import Request, RequestOutput, RequestStatus
from jds.engine.sampling import SamplingParams, SamplingRows, sample
from jds.engine.scheduler import Scheduler, SchedulerOutput

__all__ = ["BlockManager", "Engine", "EngineStats", "Request", "RequestOutput", "RequestStatus",
           "SamplingParams", "SamplingRows", "sample", "Scheduler", "SchedulerOutput"]
