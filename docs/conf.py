"""Sphinx configuration of fluxpy's documentation: the pages in docs/ and the API reference from the docstrings.

Build (as .ci/run does): ``python3 -m sphinx -W --keep-going -n -E -q -b html docs docs/_build/html``.
"""
import importlib
import inspect
import sys
import types

import fluxpy

project = "fluxpy"
release = version = fluxpy.__version__
author = "fluxpy's authors"
copyright = "fluxpy's authors"

extensions = ["sphinx.ext.autodoc", "myst_parser"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
# The older notes beside the pages (design records, measurements) are not part of the site.
exclude_patterns = ["_build", "history", "cudnn_frontend.md"]
myst_heading_anchors = 3

html_theme = "furo"
html_title = f"fluxpy {release}"

# The docstrings are reStructuredText with doctests; types stay in the signatures, where they are written.
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True}
add_module_names = True

# ---------------------------------------------------------------------------------------------
# Cross-references. Each public object is documented once, under the name users type (``fluxpy.setup``, not
# ``fluxpy.optimise.update.setup``), while the docstrings name objects as their own modules see them. A reference
# that Sphinx does not find is looked up by import: a documented object under another name gets a link to its
# entry; a real object that is not part of the reference (private to fluxpy, or another library's) is shown as
# code without a link; a name that imports as nothing stays an error (nitpicky mode, -n).

_MISSING = object()


def _import(path):
    """The object a dotted path names, or _MISSING: attributes first (``fluxpy.options`` is the options object,
    not the module of that name), then the longest importable module and attributes of it."""
    parts = path.split(".")
    try:
        obj = importlib.import_module(parts[0])
    except ImportError:
        obj = _MISSING
    for i in range(1, len(parts)):
        if obj is _MISSING:
            break
        obj = getattr(obj, parts[i], sys.modules.get(".".join(parts[:i + 1]), _MISSING))
    if obj is not _MISSING:
        return obj
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr, _MISSING)
            if obj is _MISSING:
                break
        else:
            return obj
    builtin = getattr(importlib.import_module("builtins"), path, _MISSING)
    # the name a type gives itself in an annotation Sphinx printed (``module`` for types.ModuleType)
    return _TYPE_NAMES.get(path, _MISSING) if builtin is _MISSING else builtin


_TYPE_NAMES = {t.__name__: t for t in vars(types).values() if isinstance(t, type)}


def _documented(env):
    """id(object) -> (documented name, object type) for every object of the reference."""
    table = getattr(env, "_fluxpy_documented", None)
    if table is None:
        table = {}
        for name, entry in env.get_domain("py").objects.items():
            obj = _import(name)
            if obj is not _MISSING and not isinstance(obj, (int, float, str, tuple, bool, type(None))):
                table.setdefault(id(obj), (name, entry.objtype))
        env._fluxpy_documented = table
    return table


def _contexts(node):
    """Where a short name in this reference may live: the page's current module and class, then the module of
    the object whose docstring holds the reference."""
    places = [node.get("py:module"), node.get("py:class") and f"{node.get('py:module')}.{node.get('py:class')}"]
    source = node.source or ""
    if "docstring of " in source:
        owner = source.split("docstring of ")[-1]
        places.append(owner)
        while "." in owner:
            owner = owner.rsplit(".", 1)[0]
            places.append(owner)
    return [p for p in places if p] + ["fluxpy"]


def _resolve(app, env, node, contnode):
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"].lstrip(".~")
    if not all(part.isidentifier() for part in target.split(".")):
        return contnode  # a piece of an annotation Sphinx could not parse (``int | tuple[int, ...]``), not a name
    for place in [None, *_contexts(node)]:
        obj = _import(f"{place}.{target}" if place else target)
        if obj is _MISSING:
            continue
        found = _documented(env).get(id(obj))
        if found is not None:
            name, objtype = found
            role = "mod" if objtype == "module" else "obj"
            return env.get_domain("py").resolve_xref(env, node["refdoc"], app.builder, role, name, node, contnode)
        return contnode  # real, but not in the reference: plain code
    return None


# ---------------------------------------------------------------------------------------------
# A constant re-exported by a package (``fluxpy.models.RESNETS``) has its docstring (the string after its
# assignment) in the module that defines it; autodoc reads only the package's source and would show the docstring
# of the value's type (``dict``'s) instead.

def _constant_docstring(app, what, name, obj, options, lines):
    if what != "data" or not lines or "\n".join(lines).strip() != inspect.cleandoc(type(obj).__doc__ or "").strip():
        return
    from sphinx.pycode import ModuleAnalyzer
    short = name.rsplit(".", 1)[-1]
    homes = sorted(m for m, module in list(sys.modules.items())
                   if m.startswith("fluxpy") and getattr(module, short, _MISSING) is obj)
    for home in homes:
        docs = ModuleAnalyzer.for_module(home).find_attr_docs().get(("", short))
        if docs:
            lines[:] = list(docs)
            return
    if type(obj).__module__ == "builtins":
        lines[:] = []


# ---------------------------------------------------------------------------------------------
# The reference must hold every public name: fluxpy.__all__ and the __all__ of the packages it exports.

PACKAGES = ["fluxpy", "fluxpy.ops", "fluxpy.losses", "fluxpy.optimise", "fluxpy.schedules", "fluxpy.datasets",
            "fluxpy.models", "fluxpy.layout", "fluxpy.distributed", "fluxpy.options"]


def _check_complete(app, env):
    from sphinx.util import logging
    documented = _documented(env)
    for package in PACKAGES:
        module = sys.modules.get(package) or importlib.import_module(package)
        for name in module.__all__:
            obj = getattr(module, name)
            if isinstance(obj, types.ModuleType) or id(obj) in documented:
                continue
            if f"{package}.{name}" not in env.get_domain("py").objects:
                logging.getLogger("fluxpy.docs").warning(
                    "%s.%s is public (in %s.__all__) but not in the API reference: add it to a page of docs/api/",
                    package, name, package)


def setup(app):
    app.connect("missing-reference", _resolve)
    app.connect("autodoc-process-docstring", _constant_docstring)
    app.connect("env-check-consistency", _check_complete)
