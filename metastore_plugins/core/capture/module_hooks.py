"""How a :class:`~metastore_plugins.core.capture.session.CaptureSession` hooks a model: the walk over its modules.

:class:`ModuleHooks` is the session's base: it finds each covered module's rule (or the generic rule), hooks
it with a :class:`~metastore_plugins.core.capture.context.ModuleContext`, hooks every BatchNorm and the
model's own forward, and reports the trainable parameters no rule captures.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from metastore_plugins.core.capture.context import ModuleContext, SessionLink, batch_dim_of, missed_parameters
from metastore_plugins.core.capture.layers.generic import generic_rule
from metastore_plugins.core.capture.registry import CaptureRule, find_rule


class ModuleHooks:
    """The hooking half of :class:`~metastore_plugins.core.capture.session.CaptureSession` (its state is the
    session's, set in its constructor)."""

    model: nn.Module
    modules: tuple[str, ...] | None
    generic: bool
    batch_dims: dict[str, int]
    _handles: list[RemovableHandle]
    _uncaptured: dict[str, None]
    _generic: dict[str, None]
    _hooked: set[str]
    _link: SessionLink
    _attached: bool
    _paused: bool
    _in_records: bool
    _model_forward_done: Callable[[nn.Module, tuple[Any, ...], Any], None]
    _batch_norm_called: Callable[[str, dict[int, str], nn.Module, tuple[Any, ...], dict[str, Any]], None]
    _report_unsupported: Callable[[str, str, list[str]], None]

    def _norm_hook(self, path: str, canonical: dict[int, str]) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            self._batch_norm_called(path, canonical, module, args, kwargs)

        return hook

    def _wanted(self, path: str) -> bool:
        return self.modules is None or any(path == m or path.startswith(m + ".") for m in self.modules)

    def _hook_modules(self) -> None:
        canonical = {id(p): name for name, p in self.model.named_parameters()}
        covered: set[int] = set()
        self._walk(self.model, "", [], canonical, covered)
        self._handles.append(self.model.register_forward_hook(self._model_forward_done))
        for path, module in self.model.named_modules():  # every one, captured or not: it mixes what is below it
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                self._handles.append(module.register_forward_hook(self._norm_hook(path, canonical), with_kwargs=True))
        for name, param in self.model.named_parameters():
            if param.requires_grad and id(param) not in covered and self._wanted(name):
                self._uncaptured[name] = None

    def _walk(
        self, module: nn.Module, path: str, ancestors: list[nn.Module], canonical: dict[int, str], covered: set[int]
    ) -> None:
        wanted = self._wanted(path)
        rule = find_rule(module) if wanted else None
        generic = rule is None and wanted and self.generic
        if generic:  # the module's own trainable parameters (None: it has none)
            rule = generic_rule(module)
        if rule is not None:
            self._hook(module, path, ancestors, rule, canonical, covered)
            if generic:
                own = [p for _, p in module.named_parameters(recurse=False) if p.requires_grad]
                self._generic.update({canonical[id(p)]: None for p in own})
            if rule.covers_children:
                return
        elif wanted:  # modules left out by `modules=` are not reported
            self._check_own_parameters(module, path)
        for child_name, child in module.named_children():
            self._walk(child, f"{path}.{child_name}" if path else child_name, [*ancestors, module], canonical, covered)

    def _hook(
        self,
        module: nn.Module,
        path: str,
        ancestors: list[nn.Module],
        rule: CaptureRule,
        canonical: dict[int, str],
        covered: set[int],
    ) -> None:
        params: dict[str, str] = {}
        own = dict(module.named_parameters(remove_duplicate=False))
        for local in rule.params:
            param = own.get(local)
            if param is not None and param.requires_grad:
                params[local] = canonical[id(param)]
                covered.add(id(param))
        self._check_uncovered_parameters(module, path, rule)
        if not params:
            return
        self._hooked.update(params.values())
        context = ModuleContext(self._link, path, batch_dim_of(path, ancestors, self.batch_dims), params)

        def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
            if self._attached and not self._paused and not self._in_records:
                return rule.forward(mod, args, kwargs, output, context)  # a rule may replace the output
            return None

        self._handles.append(module.register_forward_hook(hook, with_kwargs=True))

    def _check_uncovered_parameters(self, module: nn.Module, path: str, rule: CaptureRule) -> None:
        """Report trainable parameters of a ruled module that its rule does not capture (e.g. MHA ``bias_k``)."""
        local_params = module.named_parameters(recurse=rule.covers_children)
        missed = [name for name, p in local_params if p.requires_grad and name not in rule.params]
        self._report_missed(module, path, missed, has_rule=True)

    def _check_own_parameters(self, module: nn.Module, path: str) -> None:
        own = [name for name, p in module.named_parameters(recurse=False) if p.requires_grad]
        self._report_missed(module, path, own, has_rule=False)

    def _report_missed(self, module: nn.Module, path: str, names: list[str], has_rule: bool) -> None:
        if names:
            full, message = missed_parameters(path, module, names, has_rule)
            self._report_unsupported(path, message, full)
