"""sparkd: an LLM inference server that drives NVIDIA GPUs directly through cuda-python."""

from importlib.metadata import PackageNotFoundError, version

from .engine.outputs import CompletionOutput, RequestOutput
from .engine.sampling_params import SamplingParams

try:
    __version__ = version("sparkd")
except PackageNotFoundError:
    __version__ = "0.0.0+local"


def __getattr__(name: str):
    # LLM pulls in the engine and models; load it only when asked for.
    if name == "LLM":
        from .llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]
