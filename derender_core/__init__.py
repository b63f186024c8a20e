"""derender: vLLM's derender core over files, offline and on CPU.

Importing this package does not import vLLM; `DerenderEngine.build` and
`ServeEngine.build` do.
"""

from .api import RenderError, engine_for, release_engines
from .batch import Failure, Job, Outcome, OutcomeSource, RecordProcessor, Report, Restored, run
from .checks import check_body
from .compare import Divergence, Normalization, Observed, compare
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
from .parity import PATHS, Chunking, Parity, from_serve, requests_of
from .protocol import Answer, Derenderer, Endpoint, FramesAnswer, StreamAnswer
from .records import (
    OutputFile,
    Record,
    RequestIndex,
    iter_records,
    open_input,
    open_output,
    refuse_overwriting,
)
from .responses import Item, diff_items, read_items
from .streams import ChunkFacts, StreamLedger
from .vllm_seam.render import DerenderEngine
from .vllm_seam.serve import ServeEngine, StopFinding
from .writers import AssembledWriter, Assembly, ErrorLog, JsonlWriter, SseWriter, Writer

__all__ = [
    "Answer",
    "AssembledWriter",
    "Assembly",
    "ChunkFacts",
    "Chunking",
    "ConfigError",
    "DerenderEngine",
    "DerenderError",
    "Derenderer",
    "Divergence",
    "Endpoint",
    "ErrorLog",
    "ExitStatus",
    "Failure",
    "FramesAnswer",
    "InputError",
    "Item",
    "Job",
    "JsonlWriter",
    "LogKind",
    "Normalization",
    "Observed",
    "Outcome",
    "OutcomeSource",
    "OutputFile",
    "PATHS",
    "Parity",
    "Record",
    "RecordError",
    "RecordProcessor",
    "RenderConfig",
    "RenderError",
    "Report",
    "RequestIndex",
    "Restored",
    "RunIncomplete",
    "ServeEngine",
    "SseWriter",
    "StopFinding",
    "StreamAnswer",
    "StreamFailure",
    "StreamLedger",
    "Writer",
    "check_body",
    "compare",
    "diff_items",
    "engine_for",
    "from_serve",
    "iter_records",
    "open_input",
    "open_output",
    "read_items",
    "release_engines",
    "refuse_overwriting",
    "requests_of",
    "run",
]
