"""Astrolabe's global scheduler: an Envoy external processor (ext_proc) that picks the endpoint per request.

It keeps no state another replica would need: in-flight counts are per replica and rebuilt by traffic.
"""
