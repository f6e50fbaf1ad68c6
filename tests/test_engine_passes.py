"""The engine's shape: a scoring core (engine/context.py) and one module per decision-level pass
(engine/passes/), so that a new readout is a new module, not another branch in Engine.

Read from the source (no pass logic defined in the core, each pass imported and used there) and from a
run (each pass's entry points called, in the order passes/__init__.py documents)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from semif.serving.engine import passes
from semif.serving.engine.passes import injection, orders, prior, rotations
from semif.serving.engine.passes import second_look as second_look_pass
from semif.serving.engine.plan import SecondLook
from semif.serving.engine.prompt import Outcome, Question

CONTEXT = Path(__file__).resolve().parents[1] / "container" / "semif" / "serving" / "engine" / "context.py"
# What the passes took out of the core: none of these may be defined there again.
MOVED = {"combine_orders", "_debias", "content_free_shift", "_apply_prior", "_with_priors", "_content_free_key",
         "_content_free_priors", "content_free_priors", "apply_content_free", "_second_look", "_second_look_suffix",
         "_injection_check", "_prefix_after_checks", "_Priors"}
# Names only pass logic needs: the core importing one means that logic crept back.
PASS_ONLY_NAMES = {"CONTENT_FREE_STATE", "SECOND_LOOK_CUE", "SECOND_LOOK_VERSION", "SecondLookUnsupported",
                   "_question_tokens", "RULED_OUT_LOGIT", "log_softmax"}


def _context_tree() -> ast.Module:
    return ast.parse(CONTEXT.read_text(), str(CONTEXT))


def _pass_functions() -> set[str]:
    names = set()
    for name in passes.PASSES:
        module = importlib.import_module(f"semif.serving.engine.passes.{name}")
        names |= {n for n in module.__all__ if callable(getattr(module, n))}
    return names


def test_the_core_defines_no_pass_logic():
    defined = {node.name for node in ast.walk(_context_tree())
               if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    back = defined & (MOVED | _pass_functions())
    assert not back, f"pass logic defined in context.py: {sorted(back)}"
    imported = {alias.asname or alias.name for node in ast.walk(_context_tree()) if isinstance(node, ast.ImportFrom)
                for alias in node.names}
    assert not imported & PASS_ONLY_NAMES, sorted(imported & PASS_ONLY_NAMES)


# Each pass's entry points that Engine runs (passes/__init__.py lists the sequence).
ENTRY_POINTS = {"orders": {"plan_orders", "read_on_held_prefix", "read_with_own_prefix"},
                "rotations": {"read_on_held_prefix", "read_with_own_prefix"},
                "injection": {"run", "attach"}, "prior": {"plan_priors", "evaluate", "apply"},
                "second_look": {"plan_look", "run"}}


def test_every_pass_is_a_module_the_core_imports_and_calls():
    assert set(ENTRY_POINTS) == set(passes.PASSES)
    tree = _context_tree()
    aliases = {}  # the name context.py knows each pass module by -> the module
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module == "passes":
            aliases.update({alias.asname or alias.name: alias.name for alias in node.names})
    called = {(aliases.get(node.func.value.id), node.func.attr) for node in ast.walk(tree) if isinstance(node, ast.Call)
              and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)}
    for name, entries in ENTRY_POINTS.items():
        assert (CONTEXT.parent / "passes" / f"{name}.py").is_file(), name
        assert name in aliases.values(), f"context.py does not import the {name} pass"
        missing = {entry for entry in entries if (name, entry) not in called}
        assert not missing, f"context.py never calls {name}.{', '.join(sorted(missing))}"


@pytest.fixture
def calls(monkeypatch):
    """Every pass entry point Engine._execute runs, wrapped to note its module as it is called."""
    seen: list[str] = []
    for module, name in ((orders, "read_on_held_prefix"), (orders, "read_with_own_prefix"),
                         (rotations, "read_on_held_prefix"), (injection, "run"),
                         (prior, "apply"), (second_look_pass, "run")):
        real = getattr(module, name)

        def noted(*args, _real=real, _module=module.__name__.rpartition(".")[2], **kwargs):
            seen.append(_module)
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, noted)
    return seen


@pytest.mark.parametrize("layout", ["state_first", "options_first"])
def test_a_request_runs_through_every_pass_in_order(engine, calls, layout):
    question = Question("Which team should handle this ticket?", (Outcome("billing"), Outcome("shipping"), Outcome("tech")))
    result = engine.score("I was charged twice for one order.", [question], layout=layout, debias="reverse",
                          injection_check=True, second_look=SecondLook(below_margin=1.0, max_tokens=2))
    answer = result.distributions[0]
    assert answer.orders is not None and answer.injection_suspected is not None and answer.second_look is not None
    first_seen = list(dict.fromkeys(calls))
    assert first_seen == list(passes.PASSES), calls


def test_content_free_priors_come_from_the_prior_pass(engine, calls):
    question = Question("Is the customer angry?", (Outcome("yes"), Outcome("no")))
    before = engine.content_free_passes
    answer = engine.score("Where is my parcel?!", [question], debias="content_free").distributions[0]
    assert "prior" in calls and engine.content_free_passes == before + 1
    assert answer.content_free is not None and answer.debias == "content_free"


def test_reads_in_several_orders_combine_by_their_mean_log_probability():
    import numpy as np

    from semif.serving.engine.results import softmax

    def log_p(logits):
        return np.log(np.clip(np.asarray(softmax(logits)), 1e-300, None))

    given, other, third = [2.0, -1.0, 0.5], [0.3, 1.7, -2.2], [-0.4, 0.1, 3.0]
    # Two reads (debias "reverse"): exactly the average of the two log-probabilities, to the last digit.
    assert orders.combine_orders(given, other) == ((log_p(given) + log_p(other)) / 2).tolist()
    # N reads: the mean over all of them.
    three = orders.combine_orders(given, other, third)
    np.testing.assert_allclose(three, (log_p(given) + log_p(other) + log_p(third)) / 3, rtol=0, atol=1e-12)
