"""derender: vLLM's derender core over files, offline and on CPU.

Importing this package does not import vLLM; `DerenderEngine.build` does.
"""

from .batch import Failure, Job, Outcome, OutcomeSource, RecordProcessor, Report, Restored, run
from .checks import check_body
from .config import RenderConfig
from .errors import (
    ConfigError,
    DerenderError,
    ExitStatus,
    InputError,
    RecordError,
    RunIncomplete,
    StreamFailure,
)
from .logs import LogKind
from .protocol import Answer, Derenderer, Endpoint, StreamAnswer
from .records import (
    OutputFile,
    Record,
    RequestIndex,
    iter_records,
    open_input,
    open_output,
    refuse_overwriting,
)
from .streams import ChunkFacts, StreamLedger
from .vllm_seam.render import DerenderEngine
from .writers import AssembledWriter, ErrorLog, JsonlWriter, SseWriter, Writer

__all__ = [
    "Answer",
    "AssembledWriter",
    "ChunkFacts",
    "ConfigError",
    "DerenderEngine",
    "Derenderer",
    "DerenderError",
    "Endpoint",
    "ErrorLog",
    "ExitStatus",
    "Failure",
    "InputError",
    "Job",
    "JsonlWriter",
    "LogKind",
    "Outcome",
    "OutcomeSource",
    "OutputFile",
    "Record",
    "RecordProcessor",
    "RecordError",
    "RenderConfig",
    "Report",
    "RequestIndex",
    "Restored",
    "RunIncomplete",
    "SseWriter",
    "StreamAnswer",
    "StreamFailure",
    "StreamLedger",
    "Writer",
    "check_body",
    "iter_records",
    "open_input",
    "open_output",
    "refuse_overwriting",
    "run",
]
