"""README's quick start, run literally: its commands in order, fresh clone, fresh venv.

`tests/support/quick_start.py` runs them once per session (the FastAPI versions test shares its venv):
in a fresh clone they must serve `/v1/models`, a text chat, a streamed chat, an image chat and
constrained chats through the `openai` client, all 200 and each constrained answer within its
constraint, and leave a venv with the gateway only. This test then runs README's pillow-simd step
(`./scripts/install_pillow_simd.sh`) in that clone and serves again with the quick start's last
command: the start-up log, `/v1/models` and `/metrics` must name the resize path in use, first the
compiled (numba) one, then pillow-simd.
"""


import pytest

from tests.support.quick_start import QUICK_START_PORT, QuickStart, exercise_with_openai, resize_path_reports, wait_for_free_port
from tests.support.serve_process import REPO, ServeRunProcess, run_logged, serve_env

pytestmark = pytest.mark.serve


def test_readme_quick_start_serves_from_a_fresh_clone(quick_start: QuickStart, tmp_path):
    # It served (the exercise's 200s) with the exact numpy resize that stock Pillow gets.
    assert quick_start.resize_reports == ({"numba-exact"}, "numba-exact", {"numba-exact"})
    # A reaper watched it, to end the HAProxy an unclean stop would leave behind (serve_app/leftovers.py).
    assert quick_start.reaper_warnings == [] and len(quick_start.reapers) == 1, (quick_start.reaper_warnings, quick_start.reapers)
    clone, commands = quick_start.clone, quick_start.commands
    # What the quick start's venv holds: the gateway and xgrammar's grammar parser only, and pip is
    # content with it but for the dependencies xgrammar is installed without.
    run_logged([str(clone / ".venv" / "bin" / "python"), "scripts/check_gateway_venv.py"], cwd=clone, timeout_s=120)

    # README's fast resize: pillow-simd built into the venv, then the quick start's last command again
    # (its `pip install`s would put stock Pillow back over pillow-simd).
    run_logged(["./scripts/install_pillow_simd.sh"], cwd=clone, env=serve_env(), timeout_s=1800)
    serve_only = commands[-1]
    assert "./scripts/install_pillow_simd.sh" in (REPO / "README.md").read_text()
    wait_for_free_port(QUICK_START_PORT)
    with ServeRunProcess(serve_only, clone, tmp_path / "quickstart-simd.log", QUICK_START_PORT).start(ready_timeout_s=600) as serve:
        exercise_with_openai(serve.base_url)
        assert resize_path_reports(serve) == ({"pillow-simd"}, "pillow-simd", {"pillow-simd"})
