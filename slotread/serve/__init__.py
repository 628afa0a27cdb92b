"""The HTTP decision server: app factory, routes, body decoding, auth, admission, batching, metrics."""
