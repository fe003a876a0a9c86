from django.apps import AppConfig


class ChatConfig(AppConfig):
    name = "chat"
    verbose_name = "Chat"

    def ready(self) -> None:
        from chat import checks  # noqa: F401 - registers the chat's system checks
        from chat.resume import finish_unattended
        from gateway.grace import unattended_end

        # The grace sweep (every web process's monitor, Celery beat) stores the answers no
        # page came back for.
        unattended_end.connect(finish_unattended, dispatch_uid="chat.finish_unattended")
