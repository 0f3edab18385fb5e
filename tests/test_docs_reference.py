"""The reference pages (docs/reference/) are the code's own tables, rendered: each committed page equals what
`python -m jaxrl_vlm.docgen` renders now, and the rendered text lists every option, registry entry, model family,
environment, hook, subcommand and slime flag the code defines. Rendered once, in process."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import pkgutil
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import envs
from jaxrl_vlm import config, docgen, metric_catalog, slime_flags
from jaxrl_vlm.cli import build_parser
from jaxrl_vlm.engine.options import EngineOptions
from jaxrl_vlm.lora.options import LoraOptions
from jaxrl_vlm.models.config import MODEL_PRESETS
from jaxrl_vlm.models.families import FAMILIES
from jaxrl_vlm.registry import Registry
from jaxrl_vlm.rl import registries
from jaxrl_vlm.rl.losses import LossConfig, LossInputs, select_loss
from jaxrl_vlm.rl.options import LossOptions
from rollout.hooks import HOOK_OPTIONS
from rollout.options import DebugOptions, MultiTurnOptions, RolloutOptions

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    return docgen.render_all()


def test_every_page_is_rendered_and_listed_in_the_index(pages):
    assert set(pages) == {"index.md", *docgen.PAGES}
    for name in docgen.PAGES:
        assert f"]({name})" in pages["index.md"], name


@pytest.mark.parametrize("name", ["index.md", *docgen.PAGES])
def test_committed_page_is_current(pages, name):
    committed = ROOT / docgen.REFERENCE_DIR / name
    assert committed.is_file() and committed.read_text(encoding="utf-8") == pages[name], (
        f"{docgen.REFERENCE_DIR / name} is stale: regenerate the reference with `{docgen.COMMAND}`")


def test_pages_say_they_are_generated_and_hold_nothing_of_this_machine(pages):
    for name, text in pages.items():
        assert text.startswith(docgen.GENERATED + "\n"), name
        assert str(ROOT) not in text and "/tmp/" not in text, name
        assert not re.search(r"0x[0-9a-f]{6,}", text), f"{name}: an object address"
        assert not re.search(r"\]\((?!(?:[a-z]+\.md)(?:#[\w-]+)?\))", text), f"{name}: a link outside these pages"


def test_check_names_a_stale_page_and_write_fixes_it(pages, tmp_path):
    assert docgen.stale_pages(tmp_path, pages) == list(pages)  # none written yet
    assert docgen.write_pages(tmp_path, pages) == list(pages)
    assert docgen.stale_pages(tmp_path, pages) == []
    (tmp_path / docgen.REFERENCE_DIR / "models.md").write_text("edited by hand\n")
    assert docgen.stale_pages(tmp_path, pages) == ["models.md"]
    assert docgen.write_pages(tmp_path, pages) == ["models.md"]
    assert docgen.stale_pages(tmp_path, pages) == []


def test_markdown_escaping_keeps_table_cells_and_code():
    assert docgen.md("a | b <name> x*y [1, 2] `c | d` `e`") == (
        r"a \| b &lt;name&gt; x\*y \[1, 2\] <code>c &#124; d</code> `e`")
    assert docgen.md("model_type and _private") == r"model_type and \_private"


# ----------------------------------------------------------------------------- completeness
COMPOSED = (RolloutOptions, MultiTurnOptions, DebugOptions, LossOptions, LoraOptions)


@pytest.mark.parametrize("cls", [*COMPOSED, *config.SECTIONS.values()], ids=lambda c: c.__name__)
def test_every_option_of_every_composed_dataclass_is_listed(pages, cls):
    missing = [f.name for f in dataclasses.fields(cls) if f"`--{f.name.replace('_', '-')}`" not in pages["options.md"]]
    assert not missing, f"{cls.__name__}: {missing} not in options.md"


def test_every_engine_option_is_listed_as_a_serve_flag_and_in_the_serve_command(pages):
    for f in dataclasses.fields(EngineOptions):
        flag = f"`--{f.name.replace('_', '-')}`"
        assert flag in pages["options.md"] and flag in pages["cli.md"], f.name


def test_every_subcommand_is_listed(pages):
    def names(parser, prefix):
        for action in parser._actions:
            for name, sub in getattr(action, "choices", None).items() if hasattr(action, "_choices_actions") else ():
                yield f"{prefix} {name}"
                yield from names(sub, f"{prefix} {name}")

    commands = list(names(build_parser(), "jaxrl-vlm"))
    assert "jaxrl-vlm bench sharding" in commands
    for command in commands:
        assert f"## `{command}`" in pages["cli.md"], command


def test_every_slime_flag_is_listed_and_sets_real_options(pages):
    for flag, entry in slime_flags.SLIME_FLAGS.items():
        assert f"`{flag}`" in pages["options.md"], flag
        assert all(name in config.FIELDS for name in entry.fields), (flag, entry.fields)
        assert entry.applies or not entry.fields, flag


def test_every_registry_entry_is_listed(pages):
    found = [obj for obj in vars(registries).values() if isinstance(obj, Registry)]
    assert len(found) >= 5
    for registry in found:
        assert docgen.registry_title(registry) in pages["algorithms.md"], registry.kind
        for name in registry.names():
            assert f"| `{name}` |" in pages["algorithms.md"], (registry.kind, name)


def test_every_hook_is_listed(pages):
    for option in HOOK_OPTIONS:
        assert f"`{config.FIELDS[option].flag}`" in pages["algorithms.md"], option


def test_every_model_family_and_preset_is_listed(pages):
    for model_type in FAMILIES:
        assert f"| `{model_type}` |" in pages["models.md"], model_type
    for preset in MODEL_PRESETS:
        assert f"| `{preset}` |" in pages["models.md"], preset


def test_every_environment_is_listed_with_its_options(pages):
    shipped = [m.name for m in pkgutil.iter_modules(envs.__path__)
               if callable(getattr(importlib.import_module(f"envs.{m.name}"), "build_env", None))]
    assert {"geo3k", "color_reveal", "sokoban", "zoom", "gui"} <= set(shipped)
    text = pages["environments.md"]
    for name in shipped:
        assert f"## `{name}`" in text and f"--rollout-interaction-env-path envs.{name}`" in text, name
        for key in getattr(importlib.import_module(f"envs.{name}"), "CONFIG_KEYS", {}):
            assert f"| `{key}` |" in text, (name, key)


def test_every_metric_family_is_listed(pages):
    for family in metric_catalog.METRIC_FAMILIES:
        assert f"## {family.title}" in pages["metrics.md"]
        for m in family.metrics:
            assert docgen.code(m.name) in pages["metrics.md"], m.name


# ----------------------------------------------------------------------------- the catalogue against the losses
def _loss_metric_shapes(loss_type: str, policy_loss: str, correction: str) -> dict:
    b, t = 2, 8
    f32 = jax.ShapeDtypeStruct((b, t), jnp.float32)
    inputs = LossInputs(logprobs=f32, old_logprobs=f32, advantages=f32, loss_mask=f32,
                        sequence_ids=jax.ShapeDtypeStruct((b, t), jnp.int32), token_weights=f32,
                        ref_logprobs=f32, rollout_logprobs=f32, entropy=f32)
    cfg = LossConfig(eps_clip_c=3.0, use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01, num_sequences=2,
                     rollout_correction=correction)
    fn = select_loss(loss_type, policy_loss)
    return jax.eval_shape(functools.partial(fn, cfg=cfg), inputs)[1]


def test_the_catalogue_declares_every_loss_metric_with_the_reduction_the_loss_tags_it_with():
    cases = [("policy_loss", loss, "token_tis") for loss in registries.POLICY_LOSSES.names()]
    cases += [("policy_loss", "ppo_clip", c) for c in registries.ROLLOUT_CORRECTIONS.names() if c != "custom"]
    cases.append(("sft_loss", "ppo_clip", "none"))
    for case in cases:
        for name, metric in _loss_metric_shapes(*case).items():
            doc = metric_catalog.find(f"train/{name}")
            assert doc is not None, f"train/{name} ({case}) is not in the catalogue (jaxrl_vlm/rl/metrics.py)"
            assert doc.reduction.split()[0] == metric.reduction.value, (name, doc.reduction, metric.reduction)
