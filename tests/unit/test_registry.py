"""The pluggy-based ``sglang.lora_backends`` registry and the backend spec."""

from __future__ import annotations

import types

import pytest

from sglang_xpu_lora.backend import registration
from sglang_xpu_lora.registry import DuplicateBackendError, LoRABackendRegistry, LoRABackendSpec, hookimpl


def plugin_with(*specs):
    module = types.SimpleNamespace()

    @hookimpl
    def sglang_lora_backends():
        return list(specs)

    module.sglang_lora_backends = sglang_lora_backends
    return module


class FakeBackend:
    pass


def test_registers_specs_and_resolves_classes_lazily():
    calls = []
    spec = LoRABackendSpec(name="fake", factory=lambda: calls.append(1) or FakeBackend)
    registry = LoRABackendRegistry()
    registry.register_plugin(plugin_with(spec), "fake-plugin")
    assert registry.specs() == {"fake": spec}
    assert calls == []  # nothing imported until SGLang asks for the class
    assert registry.resolve_class("fake") is FakeBackend
    assert registry.spec_for_backend(FakeBackend()) is spec
    assert registry.spec_for_backend(object()) is None


def test_duplicate_backend_name_names_both_plugins_and_keeps_the_first():
    first = LoRABackendSpec(name="dup", factory=lambda: FakeBackend)
    registry = LoRABackendRegistry()
    registry.register_plugin(plugin_with(first), "first")
    with pytest.raises(DuplicateBackendError, match="'dup' is declared by both 'first' and 'second'"):
        registry.register_plugin(plugin_with(LoRABackendSpec(name="dup", factory=lambda: object)), "second")
    assert registry.get("dup") is first


def test_one_plugin_declaring_a_name_twice_is_refused():
    """Two specs of one name from one plugin would silently keep the last one."""
    registry = LoRABackendRegistry()
    twice = plugin_with(LoRABackendSpec(name="dup", factory=lambda: FakeBackend), LoRABackendSpec(name="dup", factory=lambda: object))
    with pytest.raises(DuplicateBackendError, match="'dup' is declared by both 'twice' and 'twice'"):
        registry.register_plugin(twice, "twice")
    assert registry.specs() == {}


def test_hook_returning_a_non_spec_is_rejected():
    registry = LoRABackendRegistry()
    with pytest.raises(TypeError, match="not a LoRABackendSpec"):
        registry.register_plugin(plugin_with("intel_xpu"), "bad")
    assert registry.specs() == {}


def test_broken_entry_point_is_reported_and_skipped(monkeypatch, capsys):
    class BrokenEntryPoint:
        name, value = "broken", "missing_module:plugin"

        def load(self):
            raise ImportError("No module named 'missing_module'")

    good = types.SimpleNamespace(name="ours", value="x", load=lambda: registration)
    monkeypatch.setattr(
        "importlib.metadata.entry_points", lambda group: [BrokenEntryPoint(), good] if group == "g" else []
    )
    registry = LoRABackendRegistry()
    registry.load_entrypoints("g")
    assert list(registry.specs()) == ["intel_xpu"]
    assert "broken" in registry.load_errors
    assert "skipped LoRA backend plugin 'broken'" in capsys.readouterr().err


def test_intel_xpu_spec_requirements(monkeypatch):
    spec = registration.INTEL_XPU
    assert (spec.name, spec.device) == ("intel_xpu", "xpu")
    # the instance answers from its op selection; the spec only asks it (and hands it the pool)
    backend = types.SimpleNamespace(needs_zeroed_slots=False, use_memory_pool=lambda pool: setattr(backend, "pool", pool))
    assert not spec.zeroed_slots_needed(backend)
    backend.needs_zeroed_slots = True
    assert spec.zeroed_slots_needed(backend)
    spec.receives_memory_pool(backend, "the pool")
    assert backend.pool == "the pool"
    monkeypatch.delenv("SGLANG_XPU_LORA_KERNELS", raising=False)
    assert spec.device_error("xpu") is None
    assert spec.device_error("cpu") == (
        "--lora-backend intel_xpu requires --device xpu, got --device cpu; its LoRA kernels are Intel GPU "
        "kernels (sgl-kernel-xpu, Triton on XPU); to try it on CPU (portable PyTorch kernels, for testing): "
        "set SGLANG_XPU_LORA_KERNELS=torch and SGLANG_USE_CPU_ENGINE=1 and pass --device cpu, then run "
        "`sglang-xpu-lora doctor --device cpu` to check what else SGLang\'s CPU engine needs"
    )
    assert spec.device_error("cpu", "SGLang picked it: --device was not given").startswith(
        "--lora-backend intel_xpu requires --device xpu, got --device cpu (SGLang picked it: --device was not "
        "given); its LoRA kernels"
    )
    monkeypatch.setenv("SGLANG_XPU_LORA_KERNELS", "torch")
    assert spec.device_error("cpu") is None
    assert spec.device_error("cuda") is None


def test_backend_name_the_host_already_has_is_refused():
    """A plugin may not take over a name SGLang resolves (``triton`` here); the whole plugin is
    skipped and the next one still registers."""
    from sglang_xpu_lora.registry import ReservedBackendNameError

    registry = LoRABackendRegistry()
    hijack = plugin_with(LoRABackendSpec(name="triton", factory=lambda: FakeBackend), LoRABackendSpec(name="mine", factory=lambda: FakeBackend))
    with pytest.raises(ReservedBackendNameError, match="plugin 'hijack' declares LoRA backend 'triton', a name SGLang already has"):
        registry.register_plugin(hijack, "hijack", reserved={"triton", "csgmv"})
    assert registry.specs() == {}
    registry.register_plugin(plugin_with(LoRABackendSpec(name="mine", factory=lambda: FakeBackend)), "fine", reserved={"triton"})
    assert list(registry.specs()) == ["mine"] and registry.owner("mine") == "fine"


def test_misspelled_hook_implementation_is_reported():
    """pluggy's ``check_pending``: ``sglang_lora_backend`` (no s) is not a hook of this group."""
    import pluggy

    module = types.SimpleNamespace()

    @hookimpl
    def sglang_lora_backend():
        return [LoRABackendSpec(name="typo", factory=lambda: FakeBackend)]

    module.sglang_lora_backend = sglang_lora_backend
    registry = LoRABackendRegistry()
    with pytest.raises(pluggy.PluginValidationError, match="plugin .typo.: unknown hook .sglang_lora_backend. .*the hook of sglang.lora_backends is sglang_lora_backends"):
        registry.register_plugin(module, "typo")
    registry.register_plugin(registration, "ours")  # the typo left nothing pending behind
    assert list(registry.specs()) == ["intel_xpu"]


def test_plugin_without_the_hook_is_reported():
    with pytest.raises(ValueError, match="implements no sglang_lora_backends hook"):
        LoRABackendRegistry().register_plugin(types.SimpleNamespace(), "empty")


def test_entry_point_errors_and_distributions_are_recorded(monkeypatch):
    dist = types.SimpleNamespace(name="echo-lora-backend", version="0.0.1")
    hijack = types.SimpleNamespace(
        name="hijack", value="h", dist=dist, load=lambda: plugin_with(LoRABackendSpec(name="csgmv", factory=lambda: FakeBackend))
    )
    ours = types.SimpleNamespace(name="ours", value="x", dist=types.SimpleNamespace(name="sglang-xpu-lora", version="0.1.0"), load=lambda: registration)
    monkeypatch.setattr("importlib.metadata.entry_points", lambda group: [hijack, ours] if group == "g" else [])
    registry = LoRABackendRegistry()
    registry.load_entrypoints("g", reserved={"csgmv"})
    assert list(registry.specs()) == ["intel_xpu"]
    assert "a name SGLang already has" in registry.load_errors["hijack"]
    assert registry.plugin_distributions == {"hijack": "echo-lora-backend 0.0.1", "ours": "sglang-xpu-lora 0.1.0"}
