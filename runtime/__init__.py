"""shardc.runtime"""
