"""The interactive report: segment layouts recorded during a replay (``layout``) and the
self-contained HTML/JS page that draws them with the time series (``page``)."""
