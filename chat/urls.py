"""Chat pages, plus sign-in and sign-out for chat users."""

from django.contrib.auth import views as auth_views
from django.urls import path

from chat import views

app_name = "chat"

urlpatterns = [
    path("", views.chat_page, name="index"),
    path("c/<int:pk>/", views.chat_page, name="conversation"),
    path("c/<int:pk>/rename", views.rename, name="rename"),
    path("c/<int:pk>/delete", views.delete, name="delete"),
    path("login/", auth_views.LoginView.as_view(template_name="chat/login.html",
                                                next_page="chat:index"), name="login"),
    path("logout/", auth_views.LogoutView.as_view(next_page="chat:login"), name="logout"),
]
