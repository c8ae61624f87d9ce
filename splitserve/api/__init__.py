"""The API: HTTP and OpenAI text, rendering, detokenizing and stop strings; the API worker process."""
