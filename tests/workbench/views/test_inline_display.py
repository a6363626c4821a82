"""A notebook display inline (offline): every stylesheet inlined, and Bokeh's model index rebuilt once, not once per
model (workbench/views/base.py: _batch_inline_stylesheets)."""

import json

import panel as pn
import pytest
from bokeh.document.models import DocumentModelManager

from engine import EngineConfig, LLMEngine
from workbench import Workbench
from workbench.views.base import ensure_extension


@pytest.fixture
def recomputes(monkeypatch):
    """How many times a Bokeh document walked its models to index them."""
    calls = []
    recompute = DocumentModelManager.recompute
    monkeypatch.setattr(DocumentModelManager, "recompute", lambda self: calls.append(1) or recompute(self))
    return calls


def test_a_workbench_shown_inline_walks_its_document_a_few_times_and_inlines_every_stylesheet(recomputes):
    ensure_extension()
    wb = Workbench(LLMEngine(EngineConfig(model="tiny-llama", num_kv_blocks=32)))
    data, _ = wb._repr_mimebundle_()
    text = json.dumps(data)
    # Panel swaps about 130 models' stylesheets: unbatched, each swap re-walked the document (99 walks, 25 s);
    # batched, the walks left are those of building the document (6 here)
    assert len(recomputes) <= 10, len(recomputes)
    assert text.count("InlineStyleSheet") > 100 and "ImportedStyleSheet" not in text  # offline: nothing to fetch
    docs = [view[2] for view in pn.state._views.values()]
    assert docs and all(doc.models._freeze_count == 0 for doc in docs)  # nothing left frozen


def test_a_display_that_fails_leaves_no_document_frozen(monkeypatch):
    import panel.viewable as viewable

    ensure_extension()
    managers = []
    freeze = DocumentModelManager.freeze
    monkeypatch.setattr(DocumentModelManager, "freeze", lambda self: managers.append(self) or freeze(self))

    def fail(*args, **kwargs):
        raise RuntimeError("render failed")

    monkeypatch.setattr(viewable, "render_mimebundle", fail)  # after the swaps, before the render
    with pytest.raises(RuntimeError, match="render failed"):
        pn.Column(pn.pane.Markdown("a"), pn.widgets.Button(name="b"))._repr_mimebundle_()
    assert managers and all(m._freeze_count == 0 for m in managers)  # frozen for the swaps, thawed after
