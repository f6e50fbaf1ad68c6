"""HTTP and admission: routes, request bodies, the bounded queue, auth, chat and JSON Lines.

The only layer that knows Starlette; it turns requests into contract jobs, admits them to the one
llama.cpp context, and runs the post-processing on what the engine answers."""
