"""shardc.dsl"""
