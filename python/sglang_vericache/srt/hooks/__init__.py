"""Behaviour wired into SGLang through its hook registry, each module registering its own hooks
(``register_*``, called once per process by ``srt/plugin.py``): frequency/presence penalties under
``--vericache`` (``penalties``), grammar-terminated requests finishing as SGLang's would
(``grammar_finish``), rolling a grammar matcher back over rejected drafts (``grammar_rollback``),
requests that would kill the scheduler answered with HTTP 400 (``validation``, over
``requests_check.py``), what an idle scheduler does (``idle``: drafting ahead, returning the
heap's free pages), and the one unavoidable patch (``patches``)."""
