"""derender: vLLM's derender core over files, offline and on CPU.

Importing this package does not import vLLM; `DerenderEngine.build` does.
"""

from .batch import Failure, Job, Outcome, OutcomeSource, RecordProcessor, Report, Restored, run
from .config import RenderConfig
from .errors import ConfigError, DerenderError, InputError, RecordError
from .protocol import Answer, Derenderer, Endpoint, StreamAnswer
from .records import Record, RequestIndex, iter_records, open_input, open_output
from .streams import ChunkFacts, StreamLedger
from .vllm_seam.render import DerenderEngine
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
    "InputError",
    "Job",
    "JsonlWriter",
    "Outcome",
    "OutcomeSource",
    "Record",
    "RecordProcessor",
    "RecordError",
    "RenderConfig",
    "Report",
    "RequestIndex",
    "Restored",
    "SseWriter",
    "StreamAnswer",
    "StreamLedger",
    "Writer",
    "iter_records",
    "open_input",
    "open_output",
    "run",
]
