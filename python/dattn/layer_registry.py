"""The live :class:`dattn.Attention` layers by ``id``: a ``dattn::forward`` op recorded in a
graph names its layer by id and finds it here while the layer lives (a weak table, so a graph
never keeps a layer alive)."""

import weakref

LAYERS_BY_ID: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()
