"""The package's public face (`aiayn.Transformer`, `ModelConfig`, `preset`, `Translator`): the objects of
their modules, imported on first use, so that `import aiayn` (the CLI's first import) loads no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

import aiayn


def test_import_aiayn_loads_no_torch_until_a_public_name_is_used():
    code = ("import sys, aiayn; assert 'torch' not in sys.modules, 'import aiayn loaded torch'; "
            "aiayn.Translator; assert 'torch' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_public_names_are_their_modules_objects():
    from aiayn import ModelConfig, Transformer, Translator, preset
    from aiayn import config, model, translator

    assert (Transformer, ModelConfig, preset, Translator) == (
        model.Transformer, config.ModelConfig, config.preset, translator.Translator)
    assert {"Transformer", "ModelConfig", "preset", "Translator"} <= set(dir(aiayn)) & set(aiayn.__all__)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        aiayn.Nope  # noqa: B018
    assert not hasattr(aiayn, "Nope")
