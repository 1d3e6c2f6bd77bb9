"""The public API: a small set of names at the top, the same objects whatever else is imported,
the torch side loaded on first use, the previous release's names kept as deprecated aliases."""

import importlib
import pkgutil
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import edgetrain
from edgetrain.models import build


def test_the_pure_core_plans_without_importing_torch():
    code = (
        "import sys, edgetrain\n"
        "from edgetrain import plan, simulate\n"
        "from edgetrain.core.chain import uniform_chain\n"
        "from edgetrain.paper.memory_model import paper_estimate\n"
        "chain = uniform_chain(50)\n"
        "cost = simulate(chain, plan(chain, 'optimal', max_recompute=1.5))\n"
        "assert cost.recompute_factor <= 1.5\n"
        "assert 'torch' not in sys.modules, 'the pure core imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_torch_side_names_load_on_first_use():
    model = build("resnet18")
    net = edgetrain.Checkpointed(model, torch.randn(2, 3, 64, 64), max_recompute=1.5)
    assert net.cost.recompute_factor <= 1.5
    assert isinstance(net.chain, edgetrain.Chain)


def test_every_public_name_is_the_same_object_after_every_submodule_is_imported():
    before = {name: getattr(edgetrain, name) for name in edgetrain.__all__}
    for info in pkgutil.walk_packages(edgetrain.__path__, "edgetrain."):
        if info.name != "edgetrain.measure":
            importlib.import_module(info.name)
    after = {name: getattr(edgetrain, name) for name in edgetrain.__all__}
    assert all(after[name] is before[name] for name in before), [
        name for name in before if after[name] is not before[name]
    ]
    assert all(callable(value) for value in after.values())


def test_no_public_function_is_named_like_a_module():
    modules = {
        info.name.split(".")[1] for info in pkgutil.iter_modules(edgetrain.__path__, "edgetrain.")
    }
    assert not modules & set(edgetrain.__all__)


def test_no_package_exports_a_name_one_of_its_submodules_has():
    """A submodule named like a name its package exports replaces that name on the package once
    imported (``edgetrain.core.simulate`` would turn the function into the module)."""
    for info in pkgutil.walk_packages(edgetrain.__path__, "edgetrain."):
        if not info.ispkg:
            continue
        package = importlib.import_module(info.name)
        submodules = {sub.name for sub in pkgutil.iter_modules(package.__path__)}
        assert not submodules & set(getattr(package, "__all__", ())), info.name


def test_profile_chain_works_twice_in_a_row_after_checkpointed_ran():
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    edgetrain.Checkpointed(model, x)(x).sum().backward()
    first = edgetrain.profile_chain(model, x, repeats=1)
    second = edgetrain.profile_chain(model, x, repeats=1)
    assert first.fingerprint() == second.fingerprint()
    assert edgetrain.analytic_chain(model, x).length == first.length == 3


@pytest.mark.parametrize(
    "old", ["profile", "model_chain", "build_model", "capture", "uniform_chain"]
)
def test_the_deprecated_names_still_work_and_say_what_replaces_them(old):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert callable(getattr(edgetrain, old))
    assert any(
        issubclass(w.category, DeprecationWarning) and "use " in str(w.message) for w in caught
    )


def test_plan_takes_max_recompute_as_checkpointed_does_and_the_old_name_warns():
    from edgetrain.core.chain import uniform_chain

    chain = uniform_chain(20)
    new = edgetrain.plan(chain, "optimal", max_recompute=1.5)
    with pytest.warns(DeprecationWarning, match="use max_recompute="):
        old = edgetrain.plan(chain, "optimal", recompute=1.5)
    assert list(new) == list(old) and new.params == old.params
