"""The serving engine: continuous batching of many requests on one model's KV pool."""

from .config import SLO, EngineConfig, Limits
from .controller import Thresholds
from .engine import Engine
from .request import RequestFailed, RequestHandle, SamplingParams

__all__ = ["Engine", "EngineConfig", "RequestHandle", "RequestFailed", "SamplingParams", "SLO", "Thresholds", "Limits"]
