"""The extproc reads a request's token counts as vLLM's own request models do: vLLM's CompletionRequest (in
``.venv-vllm``) and the extproc's parser agree on every value of tests/extproc/test_request.py's table."""

from __future__ import annotations

import json
import subprocess

import pytest

from deploy.vllm.launch import REPO_DIR
from tests.extproc.test_request import COUNTS_AS_VLLM_READS_THEM

pytestmark = [pytest.mark.vllm]

_VLLM_READS = """
import json, sys
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
out = []
for value in json.loads(sys.stdin.read()):
    try:
        out.append(CompletionRequest.model_validate({"model": "m", "prompt": "p", "max_tokens": value}).max_tokens)
    except Exception:
        out.append(None)
print(json.dumps(out))
"""


def test_max_tokens_is_read_as_vllms_own_request_model_reads_it():
    values = [value for value, _ in COUNTS_AS_VLLM_READS_THEM]
    result = subprocess.run([str(REPO_DIR / ".venv-vllm" / "bin" / "python"), "-c", _VLLM_READS],
                            input=json.dumps(values), capture_output=True, text=True, timeout=300, check=True)
    vllm_reads = json.loads(result.stdout.strip().splitlines()[-1])
    assert vllm_reads == [expected for _, expected in COUNTS_AS_VLLM_READS_THEM]
