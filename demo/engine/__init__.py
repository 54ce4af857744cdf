"""The generate() worker: ``engine`` (the public request API and the worker loop) over
``scheduler`` (queue, batch selection, pauses) and ``runner`` (generate() calls: ``batching``
for several rows, ``processors`` for OpenAI's sampling options), with ``generation`` (one
request between its HTTP thread and the worker) and ``textstream`` (token ids to text)."""
