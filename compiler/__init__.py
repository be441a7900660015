"""shardc.compiler"""
