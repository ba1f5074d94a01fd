"""The serving engine: continuous batching of many requests on one model's KV pool."""

from .engine import Engine
from .request import RequestFailed, RequestHandle, SamplingParams

__all__ = ["Engine", "RequestHandle", "RequestFailed", "SamplingParams"]
