"""mmserve's plain packages (no Ray): the vLLM wire mirror, the engine client, the text, image and fetch stacks, and the built-in engine."""
