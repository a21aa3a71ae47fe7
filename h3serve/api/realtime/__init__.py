"""`WS /v1/realtime/video`: real-time video sessions with vLLM-Omni's protocol (route.py)."""
