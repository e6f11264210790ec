"""The probe machine: one backend's capability verdict, with generation tokens."""
