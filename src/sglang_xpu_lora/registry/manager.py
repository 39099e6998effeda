"""Discovery of LoRA backends from the ``sglang.lora_backends`` entry-point group (pluggy)."""

from __future__ import annotations

import importlib.metadata
import sys
from typing import Collection, Optional

import pluggy

from sglang_xpu_lora.registry import hookspecs
from sglang_xpu_lora.registry.hookspecs import ENTRY_POINT_GROUP
from sglang_xpu_lora.registry.spec import LoRABackendSpec


class DuplicateBackendError(ValueError):
    """Two plugins declared the same backend name; ``names`` holds the plugin names."""

    def __init__(self, backend: str, names: tuple[str, str]):
        super().__init__(f"LoRA backend {backend!r} is declared by both {names[0]!r} and {names[1]!r}")
        self.backend = backend
        self.names = names


class ReservedBackendNameError(ValueError):
    """A plugin declared a backend name the host already has (e.g. SGLang's ``triton``)."""

    def __init__(self, backend: str, plugin: str):
        super().__init__(
            f"plugin {plugin!r} declares LoRA backend {backend!r}, a name SGLang already has; refused, "
            "so that --lora-backend keeps meaning SGLang's backend (rename the plugin's backend)"
        )
        self.backend = backend
        self.plugin = plugin


class LoRABackendRegistry:
    """Backends declared through ``sglang.lora_backends``, by name.

    Entry points are loaded one by one: a plugin that fails to import, misspells its hook, declares
    a backend another plugin or the host already has, or returns something other than specs is
    reported on stderr with its entry-point name, kept in :attr:`load_errors` and skipped; the
    others still register.
    """

    def __init__(self) -> None:
        self._pm = pluggy.PluginManager(ENTRY_POINT_GROUP)
        self._pm.add_hookspecs(hookspecs)
        self._name2spec: dict[str, LoRABackendSpec] = {}
        self._name2owner: dict[str, str] = {}
        self._class2spec: dict[type, LoRABackendSpec] = {}
        #: entry-point name -> why it was skipped
        self.load_errors: dict[str, str] = {}
        #: entry-point name -> the distribution that declares it (``name version``)
        self.plugin_distributions: dict[str, str] = {}

    def register_plugin(self, plugin: object, name: str, reserved: Collection[str] = ()) -> None:
        """Register one plugin object (module or instance with ``@hookimpl`` functions).

        :param reserved: backend names the plugin may not declare (the host's own backends).
        Raises:
            pluggy.PluginValidationError: if it implements a hook this group does not specify (a
                misspelled ``sglang_lora_backends``, found by pluggy's ``check_pending``).
            ValueError: if it implements no ``sglang_lora_backends`` hook at all.
            ReservedBackendNameError: if it declares a name in ``reserved``.
            DuplicateBackendError: if it declares a backend name another plugin already declared, or
                one name twice.
            TypeError: if its hook returns something other than ``LoRABackendSpec`` objects.
        """
        self._pm.register(plugin, name=name)
        try:
            try:
                self._pm.check_pending()
            except pluggy.PluginValidationError as exc:
                raise pluggy.PluginValidationError(
                    plugin, f"plugin {name!r}: {exc} (the hook of {ENTRY_POINT_GROUP} is sglang_lora_backends)"
                ) from exc
            specs = self._specs_of(name)
            declared: set[str] = set()
            for spec in specs:
                if spec.name in reserved:
                    raise ReservedBackendNameError(spec.name, name)
                if spec.name in self._name2owner:
                    raise DuplicateBackendError(spec.name, (self._name2owner[spec.name], name))
                if spec.name in declared:
                    raise DuplicateBackendError(spec.name, (name, name))
                declared.add(spec.name)
        except Exception:
            self._pm.unregister(name=name)
            raise
        for spec in specs:
            self._name2spec[spec.name] = spec
            self._name2owner[spec.name] = name

    def _specs_of(self, plugin_name: str) -> list[LoRABackendSpec]:
        specs: list[LoRABackendSpec] = []
        impls = [i for i in self._pm.hook.sglang_lora_backends.get_hookimpls() if i.plugin_name == plugin_name]
        if not impls:
            raise ValueError(
                f"plugin {plugin_name!r} implements no sglang_lora_backends hook (decorate it with "
                "sglang_xpu_lora.registry.hookimpl)"
            )
        for impl in impls:
            specs.extend(impl.function())
        for spec in specs:
            if not isinstance(spec, LoRABackendSpec):
                raise TypeError(f"plugin {plugin_name!r} returned {spec!r}, not a LoRABackendSpec")
        return specs

    def load_entrypoints(self, group: str = ENTRY_POINT_GROUP, reserved: Collection[str] = ()) -> None:
        """Load every entry point of ``group`` not yet registered.

        :param reserved: backend names no plugin may declare (see :meth:`register_plugin`).
        """
        for ep in importlib.metadata.entry_points(group=group):
            if self._pm.has_plugin(ep.name):
                continue
            dist = getattr(ep, "dist", None)
            if dist is not None:
                self.plugin_distributions[ep.name] = f"{dist.name} {dist.version}"
            try:
                self.register_plugin(ep.load(), ep.name, reserved)
            except Exception as exc:  # noqa: BLE001 - one broken plugin must not hide the others
                self.load_errors[ep.name] = f"{type(exc).__name__}: {exc}"
                print(
                    f"[sglang-xpu-lora] skipped LoRA backend plugin {ep.name!r} ({ep.value}): "
                    f"{type(exc).__name__}: {exc}",
                    file=sys.stderr,
                )

    def owner(self, name: str) -> Optional[str]:
        """The entry-point (plugin) name that declared backend ``name``, or None."""
        return self._name2owner.get(name)

    def specs(self) -> dict[str, LoRABackendSpec]:
        """Every registered backend, by ``--lora-backend`` name."""
        return dict(self._name2spec)

    def get(self, name: str) -> Optional[LoRABackendSpec]:
        """The spec registered under ``name``, or None (e.g. for SGLang's built-in backends)."""
        return self._name2spec.get(name)

    def resolve_class(self, name: str) -> type:
        """Call the spec's factory and remember which class belongs to which spec.

        Raises:
            KeyError: if ``name`` is not registered here.
        """
        spec = self._name2spec[name]
        cls = spec.factory()
        self._class2spec[cls] = spec
        return cls

    def spec_for_backend(self, backend: object) -> Optional[LoRABackendSpec]:
        """The spec whose factory produced ``type(backend)``, or None."""
        return self._class2spec.get(type(backend))
