from django.contrib import admin

from dashboard.models import StatsSnapshot


@admin.register(StatsSnapshot)
class StatsSnapshotAdmin(admin.ModelAdmin):
    list_display = ["taken_at", "workers", "num_pending", "num_prefilling", "num_active",
                    "kv_pressure", "active_kv_reserved", "kv_admit_blocked", "tokens_per_s"]
    date_hierarchy = "taken_at"

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False
