"""The seam to vLLM: every module that imports vLLM lives here.

One module per vLLM surface this project drives:

- `stack`: vLLM's argument parser and the stack `vllm launch render` builds;
- `render`: the render server's derender endpoints (replay and live);
- `live`: the streaming chat derender with its parser kept between calls;
- `serve`: `vllm serve`'s chat and completion handlers on a scripted engine
  core (the coupled path, from recorded token ids).

A vLLM upgrade is reviewed here and nowhere else. Importing this package
does not import vLLM: each module imports it when a path is built.
"""

import os

# vLLM picks its platform when first imported; this process has no GPU and
# needs none, so any module of the seam may be the first to import vLLM.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
# ... and none of its devices (`stack.environment_with_defaults` says why).
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
