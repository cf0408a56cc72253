"""serve: the Ray Serve application that hosts a trained arpo agent behind an OpenAI-compatible API.

It loads the policy folder of an arpo checkpoint (a plain Hugging Face folder) and runs the same tools and the same
protocol as training (``arpo_env``).
"""
