"""The front door: capture, plan file, decorator and CLI."""
