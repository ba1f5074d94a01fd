"""The serving engine: continuous batching of many requests on one model's KV pool."""

from .controller import SLO, Thresholds
from .engine import Engine
from .config import Limits
from .request import RequestFailed, RequestHandle, SamplingParams

__all__ = ["Engine", "RequestHandle", "RequestFailed", "SamplingParams", "SLO", "Thresholds", "Limits"]
