"""FX plumbing the passes share: node accessors (``nodes``), graph surgery (``edit``),
the fake value of an inserted node (``fake_values``), and a graph's nodes saved and
restored around a failing pass (``checkpoint``)."""
