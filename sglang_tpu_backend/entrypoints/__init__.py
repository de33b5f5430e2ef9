"""HTTP entry points: SGLang-native and OpenAI-compatible routes over one Engine."""
