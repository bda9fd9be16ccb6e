"""The mlx-lm internals kvstore relies on (kvstore.mlxlm.REQUIRED) exist in the installed mlx-lm.

Runs under every supported mlx-lm (`make test`: the highest, `make test-lowest`: the lowest); a
release that drops or renames one fails here, naming it.
"""

import pytest

from kvstore import mlxlm


@pytest.mark.parametrize("internal", mlxlm.REQUIRED, ids=str)
def test_internal_is_present(internal):
    assert mlxlm.present(internal), f"mlx-lm {mlxlm.version()}: {internal} is gone ({internal.why})"


def test_meta_state_probe_matches_the_version():
    major, minor = (int(p) for p in mlxlm.version().split(".")[:2])
    assert mlxlm.has_meta_state() == ((major, minor) < (0, 32))


def test_server_has_the_shape_serve_hooks_into():
    from mlx_lm import server

    from kvstore.client.persistent import PinnedPromptCache

    assert mlxlm.server_problems(server, PinnedPromptCache) == []


def test_the_adapter_imports_no_mlx():
    import subprocess
    import sys

    code = (
        "import sys, kvstore.mlxlm; "
        "print(any(m.split('.')[0] in ('mlx', 'mlx_lm') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
