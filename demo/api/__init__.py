"""The HTTP surface: ``app`` (the Flask app: chat page, OpenAI-compatible API, metrics, admin),
``server`` (waitress), ``schema`` and ``options`` (requests in), ``completions`` and
``responses`` (answers out), ``images`` (image_url parts), ``auth`` and ``auth_throttle``
(tenants, the admin token, key guessing), ``gateway`` (what the SGLang Model Gateway asks)."""
