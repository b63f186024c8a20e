"""derender: vLLM's derender core over files, offline and on CPU.

Importing this package does not import vLLM; `DerenderEngine.build` and
`ServeEngine.build` do.
"""

from .batch import Failure, Job, Outcome, RecordProcessor, Report, run
from .config import RenderConfig
from .errors import ConfigError, DerenderError, InputError, RecordError
from .protocol import Answer, Derenderer, Endpoint, FramesAnswer, StreamAnswer
from .records import Record, RequestIndex, iter_records, open_input, open_output
from .streams import ChunkFacts, StreamLedger
from .vllm_seam.render import DerenderEngine
from .vllm_seam.serve import ServeEngine, StopFinding
from .writers import AssembledWriter, JsonlWriter, SseWriter, Writer

__all__ = [
    "Answer",
    "AssembledWriter",
    "ChunkFacts",
    "ConfigError",
    "DerenderEngine",
    "Derenderer",
    "DerenderError",
    "Endpoint",
    "Failure",
    "FramesAnswer",
    "InputError",
    "Job",
    "JsonlWriter",
    "Outcome",
    "Record",
    "RecordProcessor",
    "RecordError",
    "RenderConfig",
    "Report",
    "ServeEngine",
    "RequestIndex",
    "SseWriter",
    "StreamAnswer",
    "StopFinding",
    "StreamLedger",
    "Writer",
    "iter_records",
    "open_input",
    "open_output",
    "run",
]
