"""Screenshots of `partita view` for the README: the demo plan and the planner's own plan for the
GPT-3 175B shape on 16 DGX A100 nodes (128 GPUs), both made by `compile_model`; and a data-parallel,
a tensor x pipeline and an expert-parallel plan of the golden set's models (tests/golden.py), as the
planner makes them with those degrees pinned.

    .venv/bin/python docs/make_screenshots.py

Needs Chromium at /usr/bin/chromium and the playwright package (see tests/unit/test_view.py).
"""

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from browser import CHROMIUM, CHROMIUM_ARGS  # noqa: E402
from playwright.sync_api import sync_playwright  # noqa: E402

from partita.compiler.view import render_html  # noqa: E402
from partita.core.options import Options  # noqa: E402


def demo_plan():
    from partita.compiler.compile import compile_model
    from partita.compiler.demo import BATCH, SEQ, demo_model
    from partita.core.cluster import load_cluster
    from partita.core.model.inputs import parse_input_spec

    options = Options(inputs=[parse_input_spec(f"idx=int64[{BATCH},{SEQ}]")], cluster=load_cluster("local", devices=4),
                      world_size=4)
    return compile_model(demo_model, options, name="gpt_tiny (demo)").plan


def gpt3_plan():
    sys.path.insert(0, str(ROOT))
    from examples.models import GPT, GPTConfig
    from partita.compiler.compile import compile_model
    from partita.core.cluster import load_cluster
    from partita.core.model.inputs import parse_input_spec

    def gpt3():
        return GPT(GPTConfig(vocab_size=50257, block_size=2048, n_layer=96, n_head=96, n_embd=12288))

    options = Options(inputs=[parse_input_spec("idx=int64[64,2048]")], cluster=load_cluster("dgx-a100", nodes=16))
    return compile_model(gpt3, options, name="GPT-3 175B shape").plan


def golden_plan(model: str, **pins):
    """A golden-set model (tests/golden.py) planned now with ``pins``."""
    sys.path.insert(0, str(ROOT))
    from partita.compiler.compile import compile_model
    from tests.golden import MODELS, _cluster

    factory, spec = MODELS[model]
    options = Options(inputs=[spec], cluster=_cluster(pins.pop("cluster", "local")), **pins)
    return compile_model(factory, options, name=model).plan


def shoot(context, html: str, out: Path, expand: str | None) -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".html", delete=False) as f:
        f.write(html)
    page = context.new_page()
    page.goto(Path(f.name).as_uri())
    page.wait_for_selector("body[data-ready='1']")
    if expand:
        page.locator(f'g.module[data-group="{expand}"] .head').click()
        page.mouse.move(0, 0)  # no tooltip in the picture
    page.screenshot(path=str(out), full_page=True)
    page.close()
    print(f"{out.relative_to(ROOT)}: {out.stat().st_size / 1e3:,.0f} KB")


def main() -> None:
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(tempfile.mkdtemp(), executable_path=CHROMIUM,
                                                        args=CHROMIUM_ARGS, headless=True,
                                                        viewport={"width": 1400, "height": 1000})
        shoot(context, render_html(demo_plan()), ROOT / "docs" / "view-demo.png", expand="transformer.h.0")
        plan = gpt3_plan()
        plan.save(ROOT / "docs" / "gpt3-175b.plan.json")
        shoot(context, render_html(plan), ROOT / "docs" / "view-gpt3-175b.png", expand="transformer.h.0")
        for name, plan in (("dp", golden_plan("gpt-tiny", devices=2, dp=2)),
                           ("tp-pp", golden_plan("gpt-4l", devices=4, tp=2, pp=2, grad_accum_steps=4)),
                           ("experts", golden_plan("mixtral", devices=4, dp=4, ep=2))):
            shoot(context, render_html(plan), ROOT / "docs" / f"view-{name}.png", expand=None)
        context.close()


if __name__ == "__main__":
    main()
