"""Ray Serve deployments of mmserve: thin shells over the plain classes in mmserve/ and serve_app/."""
