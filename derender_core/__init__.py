"""derender: vLLM's derender core over files, offline and on CPU.

Importing this package does not import vLLM; `DerenderEngine.build` and
`ServeEngine.build` do.
"""

from .batch import Failure, Job, Outcome, RecordProcessor, Report, run
from .compare import Divergence, Normalization, Observed, compare
from .config import RenderConfig
from .errors import ConfigError, DerenderError, InputError, RecordError
from .parity import PATHS, Chunking, Parity, from_serve, requests_of
from .protocol import Answer, Derenderer, Endpoint, FramesAnswer, StreamAnswer
from .records import Record, RequestIndex, iter_records, open_input, open_output
from .responses import Item, diff_items, read_items
from .streams import ChunkFacts, StreamLedger
from .vllm_seam.render import DerenderEngine
from .vllm_seam.serve import ServeEngine, StopFinding
from .writers import AssembledWriter, Assembly, JsonlWriter, SseWriter, Writer

__all__ = [
    "Answer",
    "AssembledWriter",
    "Assembly",
    "ChunkFacts",
    "Chunking",
    "compare",
    "ConfigError",
    "DerenderEngine",
    "Derenderer",
    "DerenderError",
    "diff_items",
    "Divergence",
    "Endpoint",
    "Failure",
    "FramesAnswer",
    "from_serve",
    "InputError",
    "Item",
    "iter_records",
    "Job",
    "JsonlWriter",
    "Normalization",
    "Observed",
    "open_input",
    "open_output",
    "Outcome",
    "Parity",
    "PATHS",
    "read_items",
    "Record",
    "RecordError",
    "RecordProcessor",
    "RenderConfig",
    "Report",
    "RequestIndex",
    "requests_of",
    "run",
    "ServeEngine",
    "SseWriter",
    "StopFinding",
    "StreamAnswer",
    "StreamLedger",
    "Writer",
]
