from django.contrib import admin

from chat.models import Conversation, Message


class MessageInline(admin.TabularInline):
    model = Message
    extra = 0
    fields = ["role", "content", "status", "finish_reason", "error", "created_at"]
    readonly_fields = fields


@admin.register(Conversation)
class ConversationAdmin(admin.ModelAdmin):
    list_display = ["__str__", "user", "tenant", "updated_at"]
    list_filter = ["tenant"]
    search_fields = ["title", "user__username"]
    inlines = [MessageInline]
