"""derender: vLLM's derender core over files, offline and on CPU.

What most code needs is here: settings (`RenderConfig`), an engine
(`DerenderEngine`, `ServeEngine`, `engine_for`) answering calls or
returning responses (`engine.chat`, `engine.completion`), whole jobs over
files (`JobSpec`, `run_job`, `ParitySpec`, `run_parity`), comparing
answers (`diff_items`), and the errors and exit statuses. Everything else
stays importable from its module (`derender_core.batch`, `.records`,
`.writers`, `.parity`, ...); the layout is in docs/architecture.md.

Importing this package does not import vLLM; building an engine does.
"""

from .api import RenderError
from .batch import Report, RunIncomplete
from .compare import Divergence, Normalization
from .config import RenderConfig
from .errors import ConfigError, DerenderError, ExitStatus, InputError, StreamFailure
from .jobs import (
    JobSpec,
    ParityResult,
    ParitySpec,
    Summary,
    engine_for,
    release_engines,
    run_job,
    run_parity,
)
from .protocol import Answer, Endpoint
from .responses import diff_items, read_items
from .vllm_seam.render import DerenderEngine
from .vllm_seam.serve import ServeEngine

__all__ = [
    "Answer",
    "ConfigError",
    "DerenderEngine",
    "DerenderError",
    "Divergence",
    "Endpoint",
    "ExitStatus",
    "InputError",
    "JobSpec",
    "Normalization",
    "ParityResult",
    "ParitySpec",
    "RenderConfig",
    "RenderError",
    "Report",
    "RunIncomplete",
    "ServeEngine",
    "StreamFailure",
    "Summary",
    "diff_items",
    "engine_for",
    "read_items",
    "release_engines",
    "run_job",
    "run_parity",
]
