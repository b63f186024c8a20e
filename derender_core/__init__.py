"""derender: vLLM's derender core over files, offline and on CPU.

Importing this package does not import vLLM; `DerenderEngine.build` does.
"""

from .batch import Failure, Job, Report, run
from .config import RenderConfig
from .engine import DerenderEngine
from .errors import ConfigError, DerenderError, InputError, RecordError
from .protocol import Answer, Endpoint
from .records import Record, RequestIndex, iter_records, open_input, open_output
from .streams import ChunkFacts, StreamLedger
from .writers import AssembledWriter, JsonlWriter, SseWriter, Writer

__all__ = [
    "Answer",
    "AssembledWriter",
    "ChunkFacts",
    "ConfigError",
    "DerenderEngine",
    "DerenderError",
    "Endpoint",
    "Failure",
    "InputError",
    "Job",
    "JsonlWriter",
    "Record",
    "RecordError",
    "RenderConfig",
    "Report",
    "RequestIndex",
    "SseWriter",
    "StreamLedger",
    "Writer",
    "iter_records",
    "open_input",
    "open_output",
    "run",
]
