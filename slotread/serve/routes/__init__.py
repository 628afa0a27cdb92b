"""One router per wire format (System One, OpenAI Decisions) plus the models and operations routes."""
