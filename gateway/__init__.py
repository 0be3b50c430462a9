"""The OpenAI-compatible HTTP gateway (`ib serve`): the fleet behind the API people already
speak. It talks to the fleet only through the client library (dispatcher.client) and keeps
no state in the process, so any number of replicas can stand behind one address."""
